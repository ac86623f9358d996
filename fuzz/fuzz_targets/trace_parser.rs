//! Arbitrary bytes as a trace file: a parsed trace or an error, never a panic or an allocation
//! the bytes do not pay for.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((trace, meta)) = ghost_oracle_reference::read_trace_bytes(data, "fuzz") {
        assert_eq!(meta.claimed_norms.len(), trace.batch_size());
        // What reads from a file satisfies the one shape rule every trace is held to.
        trace.validate().expect("a trace that reads is valid");
    }
});
