//! `remora bench startup` end to end without a GPU: `/bin/true` natively and under `remora
//! run` with embedded and standing servers on the emulated backend, over unix and tcp. The
//! program never loads libcuda, so this measures the servers' start and `remora run` alone;
//! the figures, ratios, notes, JSON report and PNG plot are what a GPU run gets.

use std::process::Command;

const REMORA: &str = env!("CARGO_BIN_EXE_remora");

#[test]
fn bench_startup_times_native_embedded_and_standing_runs() {
    let dir = tempfile::tempdir().unwrap();
    // /bin/true never loads libcuda.so.1: any file stands in for the shim.
    let shim = dir.path().join("libcuda.so");
    std::fs::write(&shim, "").unwrap();
    let (json, png) = (
        dir.path().join("startup.json"),
        dir.path().join("startup.png"),
    );
    let out = Command::new(REMORA)
        .args(["bench", "startup", "--shim"])
        .arg(&shim)
        .args(["--serve-arg=--backend", "--serve-arg=emulated"])
        .args(["--transports", "unix,tcp", "--rounds", "1", "--json"])
        .arg(&json)
        .arg("--png")
        .arg(&png)
        .args(["--program", "/bin/true 1", "--", "/bin/true"])
        .env("REMORA_LOG", "error")
        .env("REMORA_COMMIT", "abc1234")
        .output()
        .expect("run remora bench startup");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // Progress: two phases (native and embedded runs with no server up, then the standing
    // servers and native runs beside them), each with a line per program for the warm-up and
    // the round, and the round's whole run.
    let phase1 = stderr
        .find("phase 1/2: no Remora server up (native, embedded-unix, embedded-tcp)")
        .expect(&stderr);
    let phase2 = stderr
        .find(
            "phase 2/2: standing servers up (native-held, embedded-held-unix, embedded-held-tcp, \
             standing-unix, standing-tcp)",
        )
        .expect(&stderr);
    assert!(phase1 < phase2, "{stderr}");
    assert_eq!(stderr.matches("warm-up: true").count(), 4, "{stderr}");
    assert!(
        stderr[phase2..].contains(", embedded-held-tcp "),
        "embedded runs again beside the standing servers: {stderr}"
    );
    assert!(
        stderr.contains("round 1/1: true_1: native ")
            && stderr.contains(", embedded-unix ")
            && stderr.contains("round 1/1: true_1: native-held ")
            && stderr.contains(", standing-tcp "),
        "{stderr}"
    );
    assert!(
        stderr.contains("round 1/1: whole run of 2 programs: native ")
            && stderr.contains("round 1/1: whole run of 2 programs: native-held "),
        "{stderr}"
    );
    assert!(
        !stderr[phase1..phase2].contains("standing-"),
        "no standing run before phase 2: {stderr}"
    );
    assert!(stdout.contains("vs native"), "{stdout}");

    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(report["benchmark"], "startup");
    assert_eq!(report["commit"], "abc1234");
    assert_eq!(report["rounds"], 1);
    assert_eq!(report["device"], "Remora emulated device");
    assert!(report["remora"].as_str().unwrap().starts_with("remora "));
    let figures = report["figures"].as_array().unwrap();
    let modes = [
        "native",
        "embedded-unix",
        "embedded-tcp",
        "native-held",
        "embedded-held-unix",
        "embedded-held-tcp",
        "standing-unix",
        "standing-tcp",
    ];
    for metric in ["startup.true_1", "startup.true", "whole_run.total"] {
        for mode in modes {
            let f = figures
                .iter()
                .find(|f| f["mode"] == mode && f["metric"] == metric)
                .unwrap_or_else(|| panic!("{mode} {metric} missing: {report}"));
            assert_eq!(f["unit"], "s");
            assert_eq!(f["clients"], 1);
            let value = f["value"].as_f64().unwrap();
            assert!(value > 0.0 && value < 60.0, "{f}");
            assert_eq!(f["rounds"].as_array().unwrap().len(), 1, "{f}");
            if mode == "native" {
                assert!(f.get("ratio_to_native").is_none(), "{f}");
            } else {
                assert!(f["ratio_to_native"].as_f64().unwrap() > 0.0, "{f}");
            }
        }
    }
    assert_eq!(figures.len(), 3 * modes.len(), "{report}");
    // A figure's field: its value, its ratio.
    let field = |mode: &str, metric: &str, key: &str| {
        figures
            .iter()
            .find(|f| f["mode"] == mode && f["metric"] == metric)
            .unwrap()[key]
            .as_f64()
            .unwrap()
    };
    let whole = |mode: &str| field(mode, "whole_run.total", "value");
    let part = |mode: &str, metric: &str| field(mode, metric, "value");
    // The standing modes' ratios are against native-held.
    let ratio = |mode: &str| field(mode, "whole_run.total", "ratio_to_native");
    let expect = (whole("standing-tcp") / whole("native-held") * 1000.0).round() / 1000.0;
    assert!((ratio("standing-tcp") - expect).abs() < 1e-9, "{report}");
    let expect = (whole("embedded-tcp") / whole("native") * 1000.0).round() / 1000.0;
    assert!((ratio("embedded-tcp") - expect).abs() < 1e-9, "{report}");
    let expect = (whole("embedded-held-tcp") / whole("native-held") * 1000.0).round() / 1000.0;
    assert!(
        (ratio("embedded-held-tcp") - expect).abs() < 1e-9,
        "{report}"
    );
    // One round: the whole run is the sum of the programs.
    let sum = part("standing-tcp", "startup.true") + part("standing-tcp", "startup.true_1");
    assert!((whole("standing-tcp") - sum).abs() < 1e-9);
    let notes: Vec<&str> = report["notes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap())
        .collect();
    assert!(notes.iter().any(|n| n.starts_with("warm-up:")), "{notes:?}");
    assert!(
        notes.iter().any(|n| n.starts_with("native-held: ")),
        "{notes:?}"
    );
    assert!(
        notes
            .iter()
            .any(|n| n.starts_with("whole_run.programs = 2")),
        "{notes:?}"
    );
    assert!(notes.contains(&"program true_1: /bin/true 1"), "{notes:?}");
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "a PNG file");

    // `bench plot` draws the saved report again.
    let again = dir.path().join("again.png");
    let out = Command::new(REMORA)
        .args(["bench", "plot", "--json"])
        .arg(&json)
        .arg("--png")
        .arg(&again)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(again.is_file());
}

#[test]
fn a_failing_program_stops_the_benchmark_with_its_output() {
    let out = Command::new(REMORA)
        .args([
            "bench", "startup", "--modes", "native", "--rounds", "1", "--",
        ])
        .args(["sh", "-c", "echo something broke >&2; exit 7"])
        .env("REMORA_LOG", "error")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("remora: error: warm-up: sh_-c_")
            && stderr.contains("failed (exit status 7) in mode native")
            && stderr.contains("    something broke"),
        "{stderr}"
    );
}

#[test]
fn naming_no_program_or_an_unknown_mode_is_a_clear_error() {
    let run = |args: &[&str]| {
        let out = Command::new(REMORA)
            .args(["bench", "startup"])
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = run(&[]);
    assert!(err.contains("no program to time"), "{err}");
    let err = run(&["--modes", "native,fast", "--", "true"]);
    assert!(err.contains("unknown mode \"fast\""), "{err}");
    let err = run(&["--transports", "udp", "--", "true"]);
    assert!(err.contains("unknown transport \"udp\""), "{err}");
}
