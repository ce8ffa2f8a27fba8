//! Generates the rpctest service code from x/rpctest.x into OUT_DIR.
fn main() {
    if let Err(e) = remora_rpcgen::Generator::new().compile_to_out_dir("x/rpctest.x") {
        eprintln!("{e}");
        std::process::exit(1);
    }
}
