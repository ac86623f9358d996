//! The peer suite's golden traces (python/scripts/make_peer_traces.py): models shaped like a DP
//! library's own tests, whose sites have their own rows (convolutions over unfolded patches,
//! (position, group) rows, channel norms with channels last, a norm over two axes, bag members,
//! a cell at every time step, a head on pooled rows), exported with PyTorch's per-example norms
//! as the claim: each example's loss differentiated alone, in float64. The reference's truth
//! must be that norm.

use crate::cli::{run, stderr, tmp};
use ghost_oracle_reference::{read_trace, write_trace};
use std::path::{Path, PathBuf};

const PEER: [&str; 14] = [
    "conv1d-groups-dilation",
    "conv2d-groups-stride",
    "conv2d-same-reflect",
    "conv3d",
    "groupnorm-2d",
    "instancenorm2d",
    "layernorm-2-axes",
    "embeddingbag-offsets",
    "embedding-seq-first",
    "sequence-bias",
    "dplstm",
    "mha",
    "functional",
    "tied-by-matmul",
];

fn peer_trace(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("oracles/golden/traces/peer")
        .join(format!("{name}.safetensors"))
}

fn gate(path: &Path) -> Option<i32> {
    let o = run(&["check", path.to_str().unwrap(), "--gate"]);
    let code = o.status.code();
    assert!(
        code == Some(0) || code == Some(1),
        "{}: {}",
        path.display(),
        stderr(&o)
    );
    code
}

#[test]
fn the_truth_of_every_peer_site_kind_is_pytorchs_own_per_example_norm() {
    for name in PEER {
        let (rt, meta) = read_trace(&peer_trace(name)).unwrap();
        let truth = rt.materialized_norms().unwrap();
        assert_eq!(truth.len(), meta.claimed_norms.len(), "{name}");
        for (i, (e, torch)) in truth.iter().zip(&meta.claimed_norms).enumerate() {
            let n = e.total_sq.sqrt();
            assert!(
                (n - torch).abs() <= 1e-9 * torch,
                "{name} example {i}: the reference's {n:.15e}, PyTorch's {torch:.15e}"
            );
        }
        assert_eq!(gate(&peer_trace(name)), Some(0), "{name}");
    }
}

#[test]
fn a_claim_off_by_a_tenth_of_a_percent_fails_on_every_peer_trace() {
    for name in PEER {
        let (trace, mut meta) = read_trace(&peer_trace(name)).unwrap();
        meta.claimed_norms = meta.claimed_norms.iter().map(|n| n * 0.999).collect();
        let path = tmp(&format!("peer-low-{name}")).join("t.safetensors");
        write_trace(&path, &trace, &meta).unwrap();
        assert_eq!(gate(&path), Some(1), "{name}");
    }
}
