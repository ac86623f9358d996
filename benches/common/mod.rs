//! What the benches share: one warm-up call, then the median wall time of `runs` calls.

use std::time::Instant;

pub fn median_time<F: FnMut()>(runs: usize, mut f: F) -> f64 {
    f();
    let mut v: Vec<f64> = (0..runs.max(1))
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}
