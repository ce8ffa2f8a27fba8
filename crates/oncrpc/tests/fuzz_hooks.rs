//! The fuzzing entry points never panic, and process real traffic.

use proptest::prelude::*;
use remora_oncrpc::fuzzing::{FUZZ_PROGRAM, deframe, dispatch};

fn record(payload: &[u8]) -> Vec<u8> {
    let mut v = (0x8000_0000u32 | payload.len() as u32)
        .to_be_bytes()
        .to_vec();
    v.extend_from_slice(payload);
    v
}

fn call(xid: u32, vers: u32, proc_: u32, args: &[u32]) -> Vec<u8> {
    [xid, 0, 2, FUZZ_PROGRAM, vers, proc_, 0, 0, 0, 0]
        .iter()
        .chain(args)
        .flat_map(|w| w.to_be_bytes())
        .collect()
}

#[test]
fn dispatch_answers_valid_calls() {
    let mut stream = record(&call(1, 1, 2, &[2, 3]));
    stream.extend(record(&call(2, 2, 1, &[3, 0x6162_6300])));
    // reply header 24 bytes + 4 result bytes, plus header 24 + 8 for the echo, plus 2 × 4
    // record marks.
    assert_eq!(dispatch(&stream), 28 + 32 + 8);
    // A one-way call produces nothing.
    assert_eq!(dispatch(&record(&call(3, 1, 4, &[]))), 0);
    // A deep linked list is decoded without exhausting the stack (bounded depth).
    let mut args = Vec::new();
    for i in 0..5000 {
        args.extend([i, 1]);
    }
    args.extend([0, 0]);
    assert!(dispatch(&record(&call(4, 1, 5, &args))) > 0);
}

#[test]
fn hooks_survive_edge_cases() {
    for data in [
        &[][..],
        &[0xff, 0xff, 0xff, 0xff][..],
        &[0x80, 0, 0, 0][..],
        &[0, 0, 0, 0, 0, 0, 0, 0, 0x80, 0, 0, 4, 0, 0, 0, 1][..],
    ] {
        deframe(data);
        dispatch(data);
    }
}

proptest! {
    #[test]
    fn deframe_never_panics(data in proptest::collection::vec(any::<u8>(), 0..2048)) {
        deframe(&data);
    }

    #[test]
    fn dispatch_never_panics(data in proptest::collection::vec(any::<u8>(), 0..2048)) {
        dispatch(&data);
    }

    #[test]
    fn dispatch_never_panics_on_mutated_calls(
        proc_ in 0u32..8,
        vers in 0u32..4,
        args in proptest::collection::vec(any::<u32>(), 0..16),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..4),
    ) {
        let mut stream = record(&call(1, vers, proc_, &args));
        for (pos, b) in flips {
            let n = stream.len();
            stream[pos % n] ^= b;
        }
        dispatch(&stream);
    }
}
