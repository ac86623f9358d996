//! Sites with their own row counts: a trace whose sites are B×R_s×features with R_s differing
//! from site to site (a convolution's output positions, a group norm's (position, group) rows,
//! an embedding bag's members, a pooled head's single row), including one parameter used by sites
//! of different rows. The reference's truth, the built-in clippers and the judge's verdict are
//! held to per-example gradients materialized here by plain loops over the factors (Σ_rows of
//! outer products, summed over the uses of a parameter), never by the code under test.

use crate::cli::{run, stderr, tmp};
use crate::common::{cn, nm};
use candle_core::{DType, Device};
use ghost_oracle::judge::Claim;
use ghost_oracle::{
    Clipper, GhostClipper, Judge, MaterializeClipper, Precision, TiedGhostClipper, Trace, Verdict,
};
use ghost_oracle_reference::{
    read_trace, write_trace, Site, SiteKind, SiteSpec, SplitMix64, Trace as RefTrace, TraceMeta,
};
use ndarray::{Array2, Array3};
use std::collections::BTreeMap;

const B: usize = 3;
const V: usize = 5;
const D: usize = 3;

struct Gen(SplitMix64);

impl Gen {
    fn dense(&mut self, rows: usize, width: usize) -> Array3<f64> {
        let rng = &mut self.0;
        Array3::from_shape_fn((B, rows, width), |_| rng.normal())
    }

    fn site(&mut self, name: &str, param: &str, kind: SiteKind, rows: usize, dims: Dims) -> Site {
        let (backprops, activations, ids, vocab) = match (kind, dims) {
            (SiteKind::Linear | SiteKind::Conv1d, Dims::Dense { out, input }) => (
                self.dense(rows, out),
                Some(self.dense(rows, input)),
                None,
                None,
            ),
            (SiteKind::LayerNorm, Dims::Wide(out)) => (
                self.dense(rows, out),
                Some(self.dense(rows, out)),
                None,
                None,
            ),
            (SiteKind::Bias, Dims::Wide(out)) => (self.dense(rows, out), None, None, None),
            (SiteKind::Embedding, Dims::Table { vocab, out }) => {
                // Ids from part of the table, so rows repeat a token within and across examples.
                let rng = &mut self.0;
                let ids = Array2::from_shape_fn((B, rows), |_| rng.below(vocab - 1) as i64);
                (self.dense(rows, out), None, Some(ids), Some(vocab))
            }
            _ => unreachable!("a kind with the dimensions it reads"),
        };
        Site {
            spec: SiteSpec {
                name: name.into(),
                param: param.into(),
                kind,
                vocab,
            },
            activations,
            ids,
            backprops,
            conv: None,
        }
    }
}

#[derive(Clone, Copy)]
enum Dims {
    Dense { out: usize, input: usize },
    Table { vocab: usize, out: usize },
    Wide(usize),
}

/// Every kind, with rows that differ from site to site and within a parameter:
///
/// - `tied`: a token embedding on 4 ids, an embedding bag on 3 members and a head on 1 pooled
///   row (V×D);
/// - `cell`: one linear weight used on 6 rows (unfolded patches) and on 2 rows (a recurrent step);
/// - `proj`: an HF Conv1D (in×out) on 2 rows and a linear (out×in, the same layout) on 5;
/// - `gn`: a group-norm weight on 8 (position, group) rows and a layernorm of the same weight
///   on 3 rows, with its own bias `gn.bias` on 8;
/// - `conv.bias` on 9 output positions; `head.bias` on 1 row.
fn mixed_rows_trace(seed: u64) -> RefTrace {
    use Dims::*;
    use SiteKind::*;
    let mut g = Gen(SplitMix64::new(seed));
    let table = Table { vocab: V, out: D };
    RefTrace {
        sites: vec![
            g.site("wte", "tied", Embedding, 4, table),
            g.site("bag", "tied", Embedding, 3, table),
            g.site("head", "tied", Linear, 1, Dense { out: V, input: D }),
            g.site("head.bias", "head.bias", Bias, 1, Wide(V)),
            g.site("cell.x", "cell", Linear, 6, Dense { out: 2, input: 4 }),
            g.site("cell.h", "cell", Linear, 2, Dense { out: 2, input: 4 }),
            g.site("proj.c1", "proj", Conv1d, 2, Dense { out: 2, input: 3 }),
            g.site("proj.lin", "proj", Linear, 5, Dense { out: 3, input: 2 }),
            g.site("gn", "gn", LayerNorm, 8, Wide(D)),
            g.site("gn.again", "gn", LayerNorm, 3, Wide(D)),
            g.site("gn.bias", "gn.bias", Bias, 8, Wide(D)),
            g.site("conv.bias", "conv.bias", Bias, 9, Wide(2)),
        ],
    }
}

/// Example `i`'s gradient at one site in its parameter's layout, by loops over the site's rows.
fn brute_site(s: &Site, i: usize) -> Array2<f64> {
    let bp = &s.backprops;
    let (_, rows, out) = bp.dim();
    let act = || s.activations.as_ref().unwrap();
    match s.spec.kind {
        SiteKind::Linear => {
            let input = act().dim().2;
            Array2::from_shape_fn((out, input), |(o, k)| {
                (0..rows).map(|r| bp[(i, r, o)] * act()[(i, r, k)]).sum()
            })
        }
        SiteKind::Conv1d => {
            let input = act().dim().2;
            Array2::from_shape_fn((input, out), |(k, o)| {
                (0..rows).map(|r| act()[(i, r, k)] * bp[(i, r, o)]).sum()
            })
        }
        SiteKind::Embedding => {
            let ids = s.ids.as_ref().unwrap();
            let mut g = Array2::zeros((s.spec.vocab.unwrap(), out));
            for r in 0..rows {
                let id = ids[(i, r)] as usize;
                for o in 0..out {
                    g[(id, o)] += bp[(i, r, o)];
                }
            }
            g
        }
        SiteKind::Bias => {
            Array2::from_shape_fn((out, 1), |(o, _)| (0..rows).map(|r| bp[(i, r, o)]).sum())
        }
        SiteKind::LayerNorm => Array2::from_shape_fn((out, 1), |(o, _)| {
            (0..rows).map(|r| bp[(i, r, o)] * act()[(i, r, o)]).sum()
        }),
    }
}

fn frob(a: &Array2<f64>, b: &Array2<f64>) -> f64 {
    assert_eq!(a.dim(), b.dim(), "the uses of a parameter write one layout");
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The brute force of a trace.
struct Brute {
    /// Per example, per parameter (by name): the gradient summed over its sites.
    grads: Vec<BTreeMap<String, Array2<f64>>>,
    /// Per example, per site: its own gradient.
    site_grads: Vec<Vec<Array2<f64>>>,
    norms: Vec<f64>,
}

impl Brute {
    fn of(t: &RefTrace) -> Self {
        let site_grads: Vec<Vec<Array2<f64>>> = (0..B)
            .map(|i| t.sites.iter().map(|s| brute_site(s, i)).collect())
            .collect();
        let grads: Vec<BTreeMap<String, Array2<f64>>> = site_grads
            .iter()
            .map(|gs| {
                let mut m: BTreeMap<String, Array2<f64>> = BTreeMap::new();
                for (s, g) in t.sites.iter().zip(gs) {
                    match m.get_mut(&s.spec.param) {
                        Some(acc) => *acc += g,
                        None => {
                            m.insert(s.spec.param.clone(), g.clone());
                        }
                    }
                }
                m
            })
            .collect();
        let norms = grads
            .iter()
            .map(|m| m.values().map(|g| frob(g, g)).sum::<f64>().sqrt())
            .collect();
        Brute {
            grads,
            site_grads,
            norms,
        }
    }

    fn inner(&self, i: usize, k: usize) -> f64 {
        self.grads[i]
            .iter()
            .map(|(p, g)| frob(g, &self.grads[k][p]))
            .sum()
    }

    /// ⟨G_j, G_l⟩ of example i's gradients at sites j and l.
    fn site_inner(&self, i: usize, j: usize, l: usize) -> f64 {
        frob(&self.site_grads[i][j], &self.site_grads[i][l])
    }

    /// What ghost clipping without cross terms computes: √Σ_sites ‖G_j‖².
    fn own_only(&self, i: usize) -> f64 {
        self.site_grads[i]
            .iter()
            .map(|g| frob(g, g))
            .sum::<f64>()
            .sqrt()
    }
}

#[track_caller]
fn assert_rel(got: f64, want: f64, scale: f64, what: &str) {
    assert!(
        (got - want).abs() <= 1e-12 * scale,
        "{what}: {got:e} vs {want:e}"
    );
}

/// The pairs (j, l), j < l, of sites that share a parameter.
fn shared_pairs(t: &RefTrace) -> Vec<(usize, usize)> {
    let n = t.sites.len();
    (0..n)
        .flat_map(|j| (j + 1..n).map(move |l| (j, l)))
        .filter(|&(j, l)| t.sites[j].spec.param == t.sites[l].spec.param)
        .collect()
}

#[test]
fn the_test_trace_has_sites_of_different_rows_within_one_parameter() {
    let t = mixed_rows_trace(1);
    let rows = |name: &str| {
        let s = t.sites.iter().find(|s| s.spec.name == name).unwrap();
        s.backprops.dim().1
    };
    assert_eq!((rows("wte"), rows("bag"), rows("head")), (4, 3, 1));
    assert_eq!((rows("cell.x"), rows("cell.h")), (6, 2));
    assert_eq!((rows("gn"), rows("gn.again")), (8, 3));
    assert_eq!(shared_pairs(&t).len(), 3 + 1 + 1 + 1);
    // The cross terms matter: without them the norms are off (else the tied checks below would
    // hold for a clipper that drops them).
    let brute = Brute::of(&t);
    for i in 0..B {
        let off = (brute.own_only(i) - brute.norms[i]).abs() / brute.norms[i];
        assert!(
            off > 1e-3,
            "example {i}: cross terms change the norm by {off:e}"
        );
    }
}

#[test]
fn the_reference_materializes_each_site_over_its_own_rows() {
    for seed in 1..=3 {
        let t = mixed_rows_trace(seed);
        t.validate().unwrap();
        let brute = Brute::of(&t);
        let got = t.materialized_norms().unwrap();
        assert_eq!(got.len(), B);
        for (i, norm) in got.iter().enumerate() {
            let n2 = brute.norms[i].powi(2);
            assert_rel(norm.total_sq, n2, n2, &format!("seed {seed} example {i}"));
            for (j, s) in t.sites.iter().enumerate() {
                let g = t.site_gradient(j, i).unwrap();
                let want = &brute.site_grads[i][j];
                let scale = frob(want, want).sqrt();
                for (a, b) in g.iter().zip(want) {
                    assert_rel(*a, *b, scale, &format!("{} example {i}", s.spec.name));
                }
            }
            // The k×k inner products of every shared parameter's sites.
            let shared: Vec<&str> = norm.shared_inner.keys().map(String::as_str).collect();
            assert_eq!(shared, ["cell", "gn", "proj", "tied"]);
            for (param, m) in &norm.shared_inner {
                let js: Vec<usize> = (0..t.sites.len())
                    .filter(|&j| &t.sites[j].spec.param == param)
                    .collect();
                for (x, &j) in js.iter().enumerate() {
                    for (y, &l) in js.iter().enumerate() {
                        let want = brute.site_inner(i, j, l);
                        assert_rel(m[x][y], want, n2, &format!("{param} ({j}, {l})"));
                    }
                }
            }
        }
    }
}

#[test]
fn the_judges_truth_is_the_brute_force_gram_of_sites_of_different_rows() {
    for seed in 1..=3 {
        let t = mixed_rows_trace(seed);
        let brute = Brute::of(&t);
        let judge = Judge::from_trace(t.clone()).unwrap();
        let truth = &judge.truth;
        for i in 0..B {
            let n2 = brute.norms[i].powi(2);
            assert_rel(truth.norms[i], brute.norms[i], brute.norms[i], "norm");
            for k in 0..B {
                let scale = brute.norms[i] * brute.norms[k];
                assert_rel(truth.gram[i][k], brute.inner(i, k), scale, "gram");
            }
            let cross: f64 = shared_pairs(&t)
                .iter()
                .map(|&(j, l)| 2.0 * brute.site_inner(i, j, l))
                .sum();
            assert_rel(
                truth.cross_share[i].unwrap(),
                cross / n2,
                1.0,
                "cross share",
            );
            for (p, sq) in &truth.param_sq {
                let g = &brute.grads[i][p];
                assert_rel(sq[i], frob(g, g), n2, &format!("{p} example {i}"));
            }
        }
        // The accumulation length is the most rows any site sums over (the conv bias's 9).
        assert_eq!(judge.tolerance.seq_len, 9);
    }
}

crate::device_test!(clippers_sum_each_use_over_its_own_rows, |device| {
    for seed in 1..=3 {
        let t = mixed_rows_trace(seed);
        let brute = Brute::of(&t);
        let trace = Trace::from_reference(&t, DType::F64, device).unwrap();
        let tied = TiedGhostClipper.norms(&trace).unwrap();
        let materialized = MaterializeClipper.norms(&trace).unwrap();
        let ghost = GhostClipper.norms(&trace).unwrap();
        for i in 0..B {
            let n = brute.norms[i];
            assert_rel(tied.norms[i], n, n, &format!("ghost-tied example {i}"));
            assert_rel(materialized.norms[i], n, n, &format!("materialize {i}"));
            assert_rel(ghost.norms[i], brute.own_only(i), n, &format!("ghost {i}"));
            for (j, sq) in tied.site_sq.iter().enumerate() {
                let want = brute.site_inner(i, j, j);
                assert_rel(sq[i], want, n * n, &format!("own norm of site {j}"));
            }
        }
        let pairs = shared_pairs(&t);
        assert_eq!(tied.cross.len(), pairs.len());
        for c in &tied.cross {
            assert!(pairs.contains(&c.sites), "{:?}", c.sites);
            for i in 0..B {
                let want = brute.site_inner(i, c.sites.0, c.sites.1);
                let scale = brute.norms[i].powi(2);
                assert_rel(c.values[i], want, scale, &format!("cross {:?}", c.sites));
            }
        }
        // The clipped sum Σ_i c_i g_i of every parameter, at the median norm: the largest
        // example is clipped, the smallest is not.
        let mut sorted = brute.norms.clone();
        sorted.sort_by(f64::total_cmp);
        let c = sorted[B / 2];
        let clipped = TiedGhostClipper.clip(&trace, cn(c)).unwrap();
        let coef: Vec<f64> = brute.norms.iter().map(|&n| (c / n).min(1.0)).collect();
        assert!(coef.iter().any(|&x| x < 1.0) && coef.contains(&1.0));
        for (i, (got, want)) in clipped.coefficients.iter().zip(&coef).enumerate() {
            assert_rel(*got, *want, 1.0, &format!("coefficient {i}"));
        }
        for (param, sum) in &clipped.clipped_sum {
            let want = (0..B).fold(Array2::zeros(brute.grads[0][param].dim()), |acc, i| {
                acc + &brute.grads[i][param] * coef[i]
            });
            let got = sum.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
            let got: Vec<f64> = got.to_vec1().unwrap();
            let scale: f64 = (0..B).map(|i| coef[i] * brute.norms[i]).sum();
            assert_eq!(got.len(), want.len(), "{param}");
            for (a, b) in got.iter().zip(want.iter()) {
                assert_rel(*a, *b, scale, &format!("clipped sum of {param}"));
            }
        }
    }
});

fn claim(norms: &[f64], c: f64) -> Claim {
    Claim {
        norms: norms.to_vec(),
        coefficients: norms.iter().map(|&n| (c / n).min(1.0)).collect(),
        clipped_sum: None,
        clipping: Default::default(),
    }
}

#[test]
fn the_judge_passes_the_exact_norms_and_fails_norms_without_the_cross_terms() {
    let t = mixed_rows_trace(2);
    let brute = Brute::of(&t);
    let own: Vec<f64> = (0..B).map(|i| brute.own_only(i)).collect();
    let judge = Judge::from_trace(t).unwrap();
    // C below every norm: every coefficient depends on the claimed norm.
    let c = brute.norms.iter().copied().fold(f64::INFINITY, f64::min) / 2.0;
    let exact = judge
        .evaluate(
            "rows",
            &claim(&brute.norms, c),
            cn(c),
            nm(1.0),
            Precision::F64,
        )
        .unwrap();
    assert_eq!(exact.verdict, Verdict::Pass);
    assert!(
        exact.max_norm_rel_err <= 1e-12,
        "{}",
        exact.max_norm_rel_err
    );
    let dropped = judge
        .evaluate("rows", &claim(&own, c), cn(c), nm(1.0), Precision::F64)
        .unwrap();
    assert_ne!(dropped.verdict, Verdict::Pass);
    let want = (0..B)
        .map(|i| (own[i] - brute.norms[i]).abs() / brute.norms[i])
        .fold(0.0, f64::max);
    assert_rel(
        dropped.max_norm_rel_err,
        want,
        want,
        "the error of dropped cross terms",
    );
}

fn file_meta(norms: &[f64], c: f64) -> TraceMeta {
    TraceMeta {
        clipper: Some("rows-test".into()),
        ..TraceMeta::norms(c, norms.to_vec(), Precision::F64)
    }
}

#[test]
fn a_trace_file_with_sites_of_different_rows_reads_back_and_is_checked_end_to_end() {
    let t = mixed_rows_trace(3);
    let brute = Brute::of(&t);
    let c = brute.norms.iter().copied().fold(f64::INFINITY, f64::min) / 2.0;
    let dir = tmp("rows-file");
    let exact = dir.join("exact.safetensors");
    write_trace(&exact, &t, &file_meta(&brute.norms, c)).unwrap();
    let (back, meta) = read_trace(&exact).unwrap();
    assert_eq!(meta.claimed_norms, brute.norms);
    for (a, b) in back.sites.iter().zip(&t.sites) {
        assert_eq!(a.spec, b.spec);
        assert_eq!(a.backprops, b.backprops, "{}", a.spec.name);
        assert_eq!(a.activations, b.activations, "{}", a.spec.name);
        assert_eq!(a.ids, b.ids, "{}", a.spec.name);
    }
    let o = run(&["check", exact.to_str().unwrap(), "--gate"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let own: Vec<f64> = (0..B).map(|i| brute.own_only(i)).collect();
    let dropped = dir.join("dropped.safetensors");
    write_trace(&dropped, &t, &file_meta(&own, c)).unwrap();
    let o = run(&["check", dropped.to_str().unwrap(), "--gate"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
}

/// Each inconsistency refused in memory, by the device trace and in a file, naming the site and
/// the tensor.
#[test]
fn sites_that_disagree_on_the_batch_or_on_their_own_rows_are_refused_by_name() {
    type Edit = dyn Fn(&mut RefTrace);
    let cases: [(&Edit, &str); 5] = [
        (
            &|t| t.sites[5].backprops = Array3::zeros((B + 1, 2, 2)),
            "site `cell.h`: `cell.h.backprops` is 4×2×2 in batch × rows × features but site `wte` has batch 3",
        ),
        (
            &|t| t.sites[4].activations = Some(Array3::zeros((B, 5, 4))),
            "site `cell.x`: `cell.x.activations` is 3×5 in batch × rows but `cell.x.backprops` is 3×6",
        ),
        (
            &|t| t.sites[9].backprops = Array3::zeros((B, 4, D)),
            "site `gn.again`: `gn.again.activations` is 3×3 in batch × rows but `gn.again.backprops` is 3×4",
        ),
        (
            &|t| t.sites[1].ids = Some(Array2::zeros((B, 4))),
            "site `bag`: `bag.ids` is 3×4 in batch × rows but `bag.backprops` is 3×3",
        ),
        (
            &|t| t.sites[3].backprops = Array3::zeros((B, 0, V)),
            "site `head.bias`: `head.bias.backprops` is 3×0×5: no rows",
        ),
    ];
    let dir = tmp("rows-refused");
    for (k, (edit, want)) in cases.iter().enumerate() {
        let mut t = mixed_rows_trace(1);
        edit(&mut t);
        let err = t.validate().unwrap_err().to_string();
        assert!(err.contains(want), "{err:?} lacks {want:?}");
        let err = Trace::from_reference(&t, DType::F64, &Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(err.contains(want), "{err:?} lacks {want:?}");
        let path = dir.join(format!("{k}.safetensors"));
        write_trace(&path, &t, &file_meta(&[1.0; B], 1.0)).unwrap();
        let err = read_trace(&path).unwrap_err().to_string();
        assert_eq!(
            err,
            format!(
                "{}: {want_full}",
                path.display(),
                want_full = t.validate().unwrap_err()
            )
        );
        let o = run(&["check", path.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        assert!(stderr(&o).contains(want), "{}", stderr(&o));
    }
}
