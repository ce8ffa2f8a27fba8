//! Generates the protocol code from x/remora.x into OUT_DIR: the types, client and server
//! trait (remora-rpcgen), and the per-call glue macros of the `@glue`-annotated procedures
//! (remora-glue).
fn main() {
    if let Err(e) = remora_rpcgen::Generator::new().compile_to_out_dir("x/remora.x") {
        eprintln!("{e}");
        std::process::exit(1);
    }
    let out = std::path::PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    match remora_glue::generate(std::path::Path::new("x/remora.x")) {
        Ok(code) => {
            if let Err(e) = std::fs::write(out.join("glue.rs"), code) {
                eprintln!("writing glue.rs: {e}");
                std::process::exit(1);
            }
        }
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
}
