//! The `ghost-oracle` command line: the f64 reference, audits of clippers, checks of trace
//! files, trace export, benchmarks and the kill matrix, with their reports as text, JSON, HTML
//! or JUnit.

mod cli;

fn main() -> std::process::ExitCode {
    keep_freed_memory();
    cli::main()
}

/// glibc hands every freed block above its mmap threshold (at most 32 MB) back to the kernel,
/// and the next block of that size is fresh pages the kernel must clear first. The reference,
/// the judge and the clippers allocate and free such blocks all the time: at the Qwen2.5-0.5B
/// shape clearing and unmapping pages took a quarter of `audit --model`'s time. Serving every
/// block from the heap and keeping what is freed (trimmed only past 2 GB free) cut that run
/// from 2 min 21 s to 1 min 42 s for 5 % more peak memory (docs/results.md). A `MALLOC_*_`
/// variable the user sets wins.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn keep_freed_memory() {
    use std::ffi::c_int;
    unsafe extern "C" {
        fn mallopt(param: c_int, value: c_int) -> c_int;
    }
    const M_TRIM_THRESHOLD: c_int = -1;
    const M_TOP_PAD: c_int = -2;
    const M_MMAP_MAX: c_int = -4;
    for (param, value, env) in [
        (M_MMAP_MAX, 0, "MALLOC_MMAP_MAX_"),
        (M_TRIM_THRESHOLD, c_int::MAX, "MALLOC_TRIM_THRESHOLD_"),
        (M_TOP_PAD, 256 << 20, "MALLOC_TOP_PAD_"),
    ] {
        if std::env::var_os(env).is_none() {
            // SAFETY: mallopt only sets allocator parameters; it is called before any thread
            // starts, and a rejected value leaves the default in place.
            unsafe {
                mallopt(param, value);
            }
        }
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn keep_freed_memory() {}
