//! Generates the protocol code from x/remora.x into OUT_DIR.
fn main() {
    if let Err(e) = remora_rpcgen::Generator::new().compile_to_out_dir("x/remora.x") {
        eprintln!("{e}");
        std::process::exit(1);
    }
}
