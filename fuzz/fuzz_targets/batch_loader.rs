//! Arbitrary bytes as a batch file, validated against a small model: a batch or an error.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(batch) = ghost_oracle_reference::Batch::from_bytes(data, "fuzz") {
        let cfg = ghost_oracle_reference::Gpt2Config::tiny(11, 8, 8, 1, 2);
        if batch.validate(&cfg, "fuzz").is_ok() {
            assert!(batch.len() > 0 && batch.seq_len() >= 2);
            for i in 0..batch.len() {
                assert!(!batch.targets(i).is_empty());
            }
        }
    }
});
