//! Arbitrary bytes as a trace file: a parsed trace or an error, never a panic or an allocation
//! the bytes do not pay for.
#![no_main]

use libfuzzer_sys::fuzz_target;

use ghost_oracle_reference::{read_trace_bytes_within, MemoryBudget};

/// A small budget keeps every input fast: what a header claims past it is refused unread.
const BUDGET: u64 = 64 << 20;

fuzz_target!(|data: &[u8]| {
    let budget = MemoryBudget::bytes(BUDGET);
    if let Ok((trace, meta)) = read_trace_bytes_within(data, "fuzz", budget) {
        assert_eq!(meta.claimed_norms.len(), trace.batch_size());
        // What reads from a file satisfies the one shape rule every trace is held to.
        trace.validate().expect("a trace that reads is valid");
        // Every site's first example reads as rows (a convolution stored as its input unfolds
        // within the budget the reader held it to).
        if trace.batch_size() > 0 {
            for site in &trace.sites {
                let rows = site.rows(0);
                assert_eq!(rows.backprops.nrows(), site.row_count());
            }
        }
    }
});
