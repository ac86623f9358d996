//! Both routes of the Gram against full gradients materialized by the reference's own brute
//! force (`Trace::site_gradient`), on random traces of every site kind and every way two sites
//! can share a parameter.

use super::*;
use ghost_oracle_reference::{Site, SiteSpec, SplitMix64};
use ndarray::{Array2, Array3};

struct Gen {
    rng: SplitMix64,
    b: usize,
    t: usize,
}

impl Gen {
    /// Factors scaled by 10^U(−2, 2), so sites of one parameter differ in size.
    fn dense(&mut self, rows: usize, width: usize) -> Array3<f64> {
        let scale = 10f64.powf(4.0 * self.rng.uniform() - 2.0);
        let (b, rng) = (self.b, &mut self.rng);
        Array3::from_shape_fn((b, rows, width), |_| scale * rng.normal())
    }

    /// Ids from a range smaller than the table, so tokens repeat within and across examples.
    fn ids(&mut self, vocab: usize) -> Array2<i64> {
        let range = (vocab / 2).max(1);
        let (b, t, rng) = (self.b, self.t, &mut self.rng);
        Array2::from_shape_fn((b, t), |_| rng.below(range) as i64)
    }

    fn site(&mut self, name: &str, param: &str, kind: SiteKind, shape: Shape) -> Site {
        let t = self.t;
        let (backprops, activations, ids, vocab) = match (kind, shape) {
            (SiteKind::Linear | SiteKind::Conv1d, Shape::Dense { out, input }) => {
                (self.dense(t, out), Some(self.dense(t, input)), None, None)
            }
            (SiteKind::Embedding, Shape::Table { vocab, out }) => {
                (self.dense(t, out), None, Some(self.ids(vocab)), Some(vocab))
            }
            (SiteKind::Bias, Shape::Norm { out, heads }) => {
                (self.dense(t * heads, out), None, None, None)
            }
            (SiteKind::LayerNorm, Shape::Norm { out, heads }) => (
                self.dense(t * heads, out),
                Some(self.dense(t * heads, out)),
                None,
                None,
            ),
            _ => unreachable!("a kind with the shape it reads"),
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
        }
    }
}

#[derive(Clone, Copy)]
enum Shape {
    Dense {
        out: usize,
        input: usize,
    },
    Table {
        vocab: usize,
        out: usize,
    },
    /// `heads` rows per position (a per-head norm); biases keep 1.
    Norm {
        out: usize,
        heads: usize,
    },
}

/// Every kind alone and every tie the layouts allow: embedding + linear head, embedding +
/// conv1d, two embeddings, a linear used twice, linear + conv1d (transposed layouts), layernorm
/// (per-head rows) + bias, a one-input linear + bias, a one-wide embedding + bias.
fn random_trace(seed: u64, b: usize, t: usize) -> RefTrace {
    let mut g = Gen {
        rng: SplitMix64::new(seed),
        b,
        t,
    };
    let (v, d, p) = (7, 3, 4);
    use Shape::*;
    use SiteKind::*;
    let table = Table { vocab: v, out: d };
    let sites = vec![
        g.site("emb", "wte", Embedding, table),
        g.site("conv_head", "wte", Conv1d, Dense { out: d, input: v }),
        g.site("head", "wte", Linear, Dense { out: v, input: d }),
        g.site("pos", "wpe", Embedding, table),
        g.site("pos2", "wpe", Embedding, table),
        g.site("c", "c", Conv1d, Dense { out: d, input: p }),
        g.site("c.b", "c.b", Bias, Norm { out: d, heads: 1 }),
        g.site("ln", "ln", LayerNorm, Norm { out: d, heads: 3 }),
        g.site("lin.0", "lin", Linear, Dense { out: d, input: p }),
        g.site("lin.1", "lin", Linear, Dense { out: d, input: p }),
        g.site("lc.lin", "lc", Linear, Dense { out: p, input: d }),
        g.site("lc.conv", "lc", Conv1d, Dense { out: d, input: p }),
        g.site("bl.bias", "bl", Bias, Norm { out: d, heads: 1 }),
        g.site("bl.ln", "bl", LayerNorm, Norm { out: d, heads: 2 }),
        g.site("one.lin", "one", Linear, Dense { out: p, input: 1 }),
        g.site("one.bias", "one", Bias, Norm { out: p, heads: 1 }),
        g.site(
            "narrow.emb",
            "narrow",
            Embedding,
            Table { vocab: v, out: 1 },
        ),
        g.site("narrow.bias", "narrow", Bias, Norm { out: v, heads: 1 }),
    ];
    RefTrace { sites }
}

fn frob(a: &Array2<f64>, b: &Array2<f64>) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The brute force: per parameter and example every site's whole gradient, from the
/// reference's own materialization. Returns (gram, cross, param_sq, scale), scale[p][i] =
/// Σ_j ‖G_{j,i,p}‖, the size of the terms a rounding error is relative to.
#[allow(clippy::type_complexity)]
fn brute(trace: &RefTrace) -> (Vec<Vec<f64>>, Vec<f64>, Vec<Vec<f64>>, Vec<Vec<f64>>) {
    let b = trace.batch_size();
    let params = trace.params();
    let mut gram = vec![vec![0.0; b]; b];
    let mut cross = vec![0.0; b];
    let mut param_sq = Vec::new();
    let mut scale = Vec::new();
    for (_, js) in &params {
        let g: Vec<Vec<Array2<f64>>> = (0..b)
            .map(|i| {
                js.iter()
                    .map(|&j| trace.site_gradient(j, i).unwrap())
                    .collect()
            })
            .collect();
        let mut sq = vec![0.0; b];
        for i in 0..b {
            for k in 0..b {
                for (x, gi) in g[i].iter().enumerate() {
                    for (y, gk) in g[k].iter().enumerate() {
                        let v = frob(gi, gk);
                        gram[i][k] += v;
                        if i == k {
                            sq[i] += v;
                            if x != y {
                                cross[i] += v;
                            }
                        }
                    }
                }
            }
        }
        param_sq.push(sq);
        scale.push(
            (0..b)
                .map(|i| g[i].iter().map(|m| frob(m, m).sqrt()).sum())
                .collect(),
        );
    }
    (gram, cross, param_sq, scale)
}

fn assert_close(got: f64, want: f64, scale: f64, what: &str) {
    assert!(
        (got - want).abs() <= 1e-12 * scale,
        "{what}: {got:e} vs {want:e} (scale {scale:e})"
    );
}

fn check_route(trace: &RefTrace, route: Route, label: &str) {
    let (gram, cross, param_sq, scale) = brute(trace);
    let got = gram_and_cross(trace, route).unwrap();
    let b = trace.batch_size();
    let total: Vec<f64> = (0..b)
        .map(|i| scale.iter().map(|s| s[i] * s[i]).sum::<f64>().sqrt())
        .collect();
    for i in 0..b {
        for k in 0..b {
            assert_close(
                got.gram[i][k],
                gram[i][k],
                total[i] * total[k],
                &format!("{label} gram ({i}, {k})"),
            );
        }
        let s2 = total[i] * total[i];
        assert_close(got.cross[i], cross[i], s2, &format!("{label} cross {i}"));
    }
    assert_eq!(got.param_sq.len(), param_sq.len());
    for (p, ((name, sq), want)) in got.param_sq.iter().zip(&param_sq).enumerate() {
        assert_eq!(name, &trace.params()[p].0);
        for i in 0..b {
            let s2 = scale[p][i] * scale[p][i];
            assert_close(sq[i], want[i], s2, &format!("{label} {name} example {i}"));
        }
    }
}

#[test]
fn both_routes_equal_the_materialized_gradients_on_every_kind_and_tie() {
    let mut seed = 1;
    for b in 1..=3 {
        for t in [1, 2, 3, 5] {
            seed += 1;
            let trace = random_trace(seed, b, t);
            trace.validate().unwrap();
            for route in [Route::Identity, Route::Materialize, Route::ByCost] {
                check_route(&trace, route, &format!("{route:?} B={b} T={t}"));
            }
        }
    }
}

#[test]
fn the_materialized_route_streamed_a_few_rows_at_a_time_equals_the_whole_gradients() {
    // Blocks of one row (every vocabulary entry of the tied table apart) and of a few rows that
    // do not divide the table: the same Gram and cross terms as whole gradients.
    for (seed, b, t) in [(71, 1, 3), (72, 2, 4), (73, 3, 2)] {
        let trace = random_trace(seed, b, t);
        for bytes in [1, 8 * 3 * b * 2 + 1] {
            with_block_bytes(bytes, || {
                check_route(
                    &trace,
                    Route::Materialize,
                    &format!("{bytes}-byte blocks B={b}"),
                );
            });
        }
    }
}

#[test]
fn both_routes_hold_uses_of_one_parameter_with_different_rows() {
    // Each site its own rows: a head on one pooled row tied to an embedding on 5 ids and a
    // conv1d head on 3 rows; one linear on 4 rows and on 1; a norm on 6 rows with a bias on 2.
    use Shape::*;
    use SiteKind::*;
    let (v, d, p) = (7, 3, 4);
    for (seed, b) in [(31, 1), (32, 2), (33, 3)] {
        let mut g = Gen {
            rng: SplitMix64::new(seed),
            b,
            t: 5,
        };
        let mut site = |rows: usize, name: &str, param: &str, kind: SiteKind, shape: Shape| {
            g.t = rows;
            g.site(name, param, kind, shape)
        };
        let trace = RefTrace {
            sites: vec![
                site(5, "emb", "wte", Embedding, Table { vocab: v, out: d }),
                site(1, "head", "wte", Linear, Dense { out: v, input: d }),
                site(3, "conv_head", "wte", Conv1d, Dense { out: d, input: v }),
                site(4, "lin.0", "lin", Linear, Dense { out: d, input: p }),
                site(1, "lin.1", "lin", Linear, Dense { out: d, input: p }),
                site(6, "bl.ln", "bl", LayerNorm, Norm { out: d, heads: 1 }),
                site(2, "bl.bias", "bl", Bias, Norm { out: d, heads: 1 }),
            ],
        };
        trace.validate().unwrap();
        for route in [Route::Identity, Route::Materialize, Route::ByCost] {
            check_route(&trace, route, &format!("{route:?} B={b} mixed rows"));
        }
    }
}

#[test]
fn the_truth_takes_norms_param_sq_and_cross_share_from_the_identity() {
    // The public Truth of a trace against the brute force: norms, the split by parameter and
    // the cross share, whichever route each parameter took.
    let trace = random_trace(99, 3, 4);
    let (gram, cross, param_sq, _) = brute(&trace);
    let truth = Truth::from_trace(trace).unwrap();
    for i in 0..3 {
        let n2 = gram[i][i];
        assert!((truth.norms[i] * truth.norms[i] - n2).abs() <= 1e-12 * n2);
        let share = truth.cross_share[i].unwrap();
        assert!(
            (share - cross[i] / n2).abs() <= 1e-11,
            "{share} vs {}",
            cross[i] / n2
        );
        for ((_, sq), want) in truth.param_sq.iter().zip(&param_sq) {
            assert!((sq[i] - want[i]).abs() <= 1e-12 * want[i].max(1e-300));
        }
    }
}

#[test]
fn the_cost_picks_the_identity_for_a_wide_head_and_materializing_for_a_narrow_layer() {
    // T = 2, B = 2: a 500×6 head costs 3000 entries per example to write but 4·(506 + 1) per
    // pair by the identity; a 2×3 layer's six entries are cheaper than any T×T product.
    let mut g = Gen {
        rng: SplitMix64::new(5),
        b: 2,
        t: 2,
    };
    let trace = RefTrace {
        sites: vec![
            g.site(
                "head",
                "head",
                SiteKind::Linear,
                Shape::Dense { out: 500, input: 6 },
            ),
            g.site(
                "small",
                "small",
                SiteKind::Linear,
                Shape::Dense { out: 2, input: 3 },
            ),
        ],
    };
    let routes: Vec<bool> = trace
        .params()
        .iter()
        .map(|(_, js)| {
            let sides: Vec<_> = js.iter().map(|&j| SiteSides::of(&trace, j)).collect();
            let (materialize, identity) = route_costs(&trace, js, &sides, 2);
            identity < materialize
        })
        .collect();
    assert_eq!(routes, vec![true, false]);
    check_route(&trace, Route::ByCost, "mixed");
}

#[test]
fn an_identity_route_on_small_integers_is_exact() {
    // Integer factors: every product and sum is an exact integer in f64 by either route, so the
    // two must agree bit for bit.
    let mut trace = random_trace(7, 2, 3);
    for s in &mut trace.sites {
        s.backprops.mapv_inplace(|x| (x * 3.0).round());
        if let Some(a) = s.activations.as_mut() {
            a.mapv_inplace(|x| (x * 3.0).round());
        }
    }
    let a = gram_and_cross(&trace, Route::Identity).unwrap();
    let m = gram_and_cross(&trace, Route::Materialize).unwrap();
    assert_eq!(a.gram, m.gram);
    assert_eq!(a.cross, m.cross);
    assert_eq!(a.param_sq, m.param_sq);
}
