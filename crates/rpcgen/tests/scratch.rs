#[test]
fn scratch() {
    for f in std::env::var("FILES").unwrap().split(',') {
        match remora_rpcgen::Generator::new().define("RPC_HDR", None).generate_file(f) {
            Ok(c) => { std::fs::write(format!("/tmp/out_{}.rs", std::path::Path::new(f).file_stem().unwrap().to_string_lossy()), c).unwrap(); }
            Err(e) => eprintln!("ERR {e}"),
        }
    }
}
