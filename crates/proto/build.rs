//! Generates the protocol code from x/remora.x into OUT_DIR: the types, client and server
//! trait (remora-rpcgen), and the per-call glue macros of the `@glue`-annotated procedures
//! (remora-glue); and `cu.rs`, the `CUresult` constants, from src/cu_results.txt.
/// `cu.rs`: a `pub const` for every `CUresult` in `src/cu_results.txt` (`CUDA_ERROR_X` is
/// `X`, `CUDA_SUCCESS` is `SUCCESS`), for `remora_proto::cuda::cu`.
fn cu_consts(table: &str) -> String {
    let mut out = String::new();
    for line in table
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
    {
        let mut parts = line.splitn(3, ' ');
        let (Some(code), Some(name), Some(text)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let short = name
            .strip_prefix("CUDA_ERROR_")
            .or_else(|| name.strip_prefix("CUDA_"));
        if let (Ok(code), Some(short)) = (code.parse::<i32>(), short) {
            out.push_str(&format!(
                "/// `{name}`: {}.\npub const {short}: i32 = {code};\n",
                text.replace('`', "'")
            ));
        }
    }
    out
}

fn main() {
    if let Err(e) = remora_rpcgen::Generator::new().compile_to_out_dir("x/remora.x") {
        eprintln!("{e}");
        std::process::exit(1);
    }
    let out = std::path::PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    println!("cargo:rerun-if-changed=src/cu_results.txt");
    let table = std::fs::read_to_string("src/cu_results.txt").expect("src/cu_results.txt");
    if let Err(e) = std::fs::write(out.join("cu.rs"), cu_consts(&table)) {
        eprintln!("writing cu.rs: {e}");
        std::process::exit(1);
    }
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
