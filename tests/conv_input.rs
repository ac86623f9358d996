//! Convolutions stored as their input and geometry (trace format /2, docs/trace-format.md): the
//! judge's true norms and the reference's materialized norms of a conv-input trace equal those
//! of its unfolded /1 twin and a brute-force per-example gradient, by either Gram route; a
//! planted error in one input value fails an exact claim; and every malformed header is refused
//! naming the site and tensor.
//!
//! Ground truth is independent of the code under test: the /1 twin and the gradients are built
//! here by plain loops over the formula G_i[o, (c, κ)] = Σ_p δ_i[p, o] · x̃_i[j·C_in/g + c,
//! p·s + κ·d] (x̃ the zero-padded input), never through the crate's unfold.

use ghost_oracle::judge::{Claim, GramRoute, Truth};
use ghost_oracle::{Judge, Verdict};
use ghost_oracle_reference::{
    read_trace, read_trace_bytes, read_trace_bytes_within, write_raw, write_trace, ConvGeometry,
    ConvInput, MemoryBudget, Precision, RawTensor, Site, SiteKind, SiteSpec, SplitMix64,
    Trace as RefTrace, TraceMeta,
};
use ndarray::{Array2, Array3, ArrayD, IxDyn};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// One convolution's shape: what a case varies.
#[derive(Clone, Debug)]
struct Conv {
    batch: usize,
    c_in: usize,
    c_out: usize,
    groups: usize,
    kernel: Vec<usize>,
    stride: Vec<usize>,
    dilation: Vec<usize>,
    padding: Vec<(usize, usize)>,
    input: Vec<usize>,
}

impl Conv {
    fn plain(c_in: usize, c_out: usize, kernel: &[usize], input: &[usize]) -> Self {
        let n = kernel.len();
        Conv {
            batch: 3,
            c_in,
            c_out,
            groups: 1,
            kernel: kernel.to_vec(),
            stride: vec![1; n],
            dilation: vec![1; n],
            padding: vec![(0, 0); n],
            input: input.to_vec(),
        }
    }

    /// torch's output size per axis, written out here.
    fn output(&self) -> Vec<usize> {
        (0..self.kernel.len())
            .map(|d| {
                let padded = self.input[d] + self.padding[d].0 + self.padding[d].1;
                let span = self.dilation[d] * (self.kernel[d] - 1) + 1;
                (padded - span) / self.stride[d] + 1
            })
            .collect()
    }

    fn geometry(&self) -> ConvGeometry {
        ConvGeometry {
            kernel: self.kernel.clone(),
            stride: self.stride.clone(),
            dilation: self.dilation.clone(),
            padding: self.padding.clone(),
            groups: self.groups,
            input_size: self.input.clone(),
        }
    }
}

/// Row-major multi-index of flat `k` in `sizes`.
fn unravel(mut k: usize, sizes: &[usize]) -> Vec<usize> {
    let mut out = vec![0; sizes.len()];
    for d in (0..sizes.len()).rev() {
        out[d] = k % sizes[d];
        k /= sizes[d];
    }
    out
}

/// Row-major flat index of `idx` in `sizes`.
fn ravel(idx: &[usize], sizes: &[usize]) -> usize {
    idx.iter().zip(sizes).fold(0, |a, (&i, &s)| a * s + i)
}

/// The batch's random factors: inputs B × C_in × ∏S, output gradients B × P × C_out.
struct Batch {
    conv: Conv,
    inputs: Array3<f64>,
    backprops: Array3<f64>,
}

impl Batch {
    fn random(conv: &Conv, seed: u64) -> Self {
        let mut rng = SplitMix64::new(seed);
        let spatial: usize = conv.input.iter().product();
        let positions: usize = conv.output().iter().product();
        let inputs =
            Array3::from_shape_simple_fn((conv.batch, conv.c_in, spatial), || rng.normal());
        let backprops =
            Array3::from_shape_simple_fn((conv.batch, positions, conv.c_out), || rng.normal());
        Batch {
            conv: conv.clone(),
            inputs,
            backprops,
        }
    }

    /// x̃_i[c, position p, offset κ]: the zero-padded input the formula reads, or 0 in padding.
    fn padded(&self, i: usize, c: usize, p: &[usize], kappa: &[usize]) -> f64 {
        let cv = &self.conv;
        let mut at = Vec::with_capacity(p.len());
        for d in 0..p.len() {
            let x = (p[d] * cv.stride[d] + kappa[d] * cv.dilation[d]) as isize
                - cv.padding[d].0 as isize;
            if x < 0 || x as usize >= cv.input[d] {
                return 0.0;
            }
            at.push(x as usize);
        }
        self.inputs[(i, c, ravel(&at, &cv.input))]
    }

    /// Example i's weight gradient C_out × (C_in/g · ∏k), by the formula.
    fn gradient(&self, i: usize) -> Array2<f64> {
        let cv = &self.conv;
        let (cin_g, cout_g) = (cv.c_in / cv.groups, cv.c_out / cv.groups);
        let k: usize = cv.kernel.iter().product();
        let out = cv.output();
        let positions: usize = out.iter().product();
        Array2::from_shape_fn((cv.c_out, cin_g * k), |(o, col)| {
            let j = o / cout_g;
            let (c, kk) = (col / k, col % k);
            let kappa = unravel(kk, &cv.kernel);
            (0..positions)
                .map(|p| {
                    self.backprops[(i, p, o)]
                        * self.padded(i, j * cin_g + c, &unravel(p, &out), &kappa)
                })
                .sum()
        })
    }

    /// ‖G_weight‖² + ‖G_bias‖² of example i by the formula (the bias's gradient Σ_p δ_p).
    fn brute_norm(&self, i: usize) -> f64 {
        let w: f64 = self.gradient(i).iter().map(|v| v * v).sum();
        let b: f64 = (0..self.conv.c_out)
            .map(|o| {
                let s: f64 = (0..self.backprops.dim().1)
                    .map(|p| self.backprops[(i, p, o)])
                    .sum();
                s * s
            })
            .sum();
        (w + b).sqrt()
    }

    fn bias(&self) -> Site {
        Site {
            spec: spec("conv.bias", SiteKind::Bias),
            activations: None,
            ids: None,
            backprops: self.backprops.clone(),
            conv: None,
        }
    }

    /// The trace in format /2: the weight site as its input and geometry, and the bias.
    fn conv_trace(&self) -> RefTrace {
        let weight = Site {
            spec: spec("conv.weight", SiteKind::Linear),
            activations: None,
            ids: None,
            backprops: self.backprops.clone(),
            conv: Some(ConvInput {
                geometry: self.conv.geometry(),
                inputs: self.inputs.clone(),
            }),
        };
        RefTrace {
            sites: vec![weight, self.bias()],
        }
    }

    /// The unfolded /1 twin, by loops: rows (position p, group j) = p·g + j, activations group
    /// j's patch (channel major, offsets row-major), backprops δ_p with other groups zeroed.
    fn unfolded_trace(&self) -> RefTrace {
        let cv = &self.conv;
        let (g, cin_g, cout_g) = (cv.groups, cv.c_in / cv.groups, cv.c_out / cv.groups);
        let k: usize = cv.kernel.iter().product();
        let out = cv.output();
        let positions: usize = out.iter().product();
        let rows = positions * g;
        let act = Array3::from_shape_fn((cv.batch, rows, cin_g * k), |(i, r, col)| {
            let (p, j) = (r / g, r % g);
            let (c, kk) = (col / k, col % k);
            self.padded(
                i,
                j * cin_g + c,
                &unravel(p, &out),
                &unravel(kk, &cv.kernel),
            )
        });
        let bp = Array3::from_shape_fn((cv.batch, rows, cv.c_out), |(i, r, o)| {
            let (p, j) = (r / g, r % g);
            if o / cout_g == j {
                self.backprops[(i, p, o)]
            } else {
                0.0
            }
        });
        let weight = Site {
            spec: spec("conv.weight", SiteKind::Linear),
            activations: Some(act),
            ids: None,
            backprops: bp,
            conv: None,
        };
        RefTrace {
            sites: vec![weight, self.bias()],
        }
    }
}

fn spec(name: &str, kind: SiteKind) -> SiteSpec {
    SiteSpec {
        name: name.to_string(),
        param: name.to_string(),
        kind,
        vocab: None,
    }
}

/// 1-D, 2-D and 3-D; stride 2, dilation 2, asymmetric padding, groups 2 and depthwise.
fn cases() -> Vec<(&'static str, Conv)> {
    let mut one = Conv::plain(3, 4, &[3], &[11]);
    one.stride = vec![2];
    one.padding = vec![(2, 1)];
    let mut two = Conv::plain(4, 6, &[3, 2], &[7, 6]);
    two.dilation = vec![2, 1];
    two.stride = vec![1, 2];
    two.padding = vec![(1, 0), (0, 2)];
    two.groups = 2;
    let mut depthwise = Conv::plain(4, 8, &[3, 3], &[6, 5]);
    depthwise.groups = 4;
    depthwise.padding = vec![(1, 1), (1, 1)];
    depthwise.stride = vec![2, 2];
    let mut three = Conv::plain(2, 3, &[2, 3, 2], &[4, 5, 3]);
    three.dilation = vec![1, 2, 1];
    three.padding = vec![(0, 1), (2, 0), (1, 1)];
    three.stride = vec![2, 1, 2];
    vec![
        ("1-D, stride 2, asymmetric padding", one),
        ("2-D, groups 2, dilation 2, stride 2", two),
        ("2-D depthwise, stride 2", depthwise),
        ("3-D, dilation 2, stride 2, asymmetric padding", three),
    ]
}

#[track_caller]
fn assert_rel(got: f64, want: f64, what: &str) {
    assert!(
        (got - want).abs() <= 1e-12 * want.abs(),
        "{what}: got {got:e}, want {want:e}"
    );
}

#[test]
fn a_conv_input_trace_gives_its_unfolded_twins_norms_and_the_brute_force_ones() {
    for (seed, (what, conv)) in cases().into_iter().enumerate() {
        let batch = Batch::random(&conv, seed as u64 + 1);
        let (stored, twin) = (batch.conv_trace(), batch.unfolded_trace());
        stored.validate().unwrap();
        twin.validate().unwrap();
        // The weight's gradient has torch's layout C_out × (C_in/g · ∏k).
        let k: usize = conv.kernel.iter().product();
        assert_eq!(
            stored.site_gradient_shape(0),
            (conv.c_out, conv.c_in / conv.groups * k),
            "{what}"
        );
        for i in 0..conv.batch {
            let g = stored.site_gradient(0, i).unwrap();
            let want = batch.gradient(i);
            let scale = want.iter().fold(0.0_f64, |a, v| a.max(v.abs()));
            for (x, y) in g.iter().zip(want.iter()) {
                assert!((x - y).abs() <= 1e-12 * scale, "{what}: {x} vs {y}");
            }
        }
        let materialized = stored.materialized_norms().unwrap();
        let twin_materialized = twin.materialized_norms().unwrap();
        let truth = Truth::from_trace(stored.clone()).unwrap();
        let twin_truth = Truth::from_trace(twin.clone()).unwrap();
        for i in 0..conv.batch {
            let want = batch.brute_norm(i);
            assert_rel(materialized[i].total_sq.sqrt(), want, what);
            assert_rel(twin_materialized[i].total_sq.sqrt(), want, what);
            assert_rel(truth.norms[i], want, what);
            assert_rel(twin_truth.norms[i], want, what);
        }
        for (a, b) in truth
            .gram
            .iter()
            .flatten()
            .zip(twin_truth.gram.iter().flatten())
        {
            assert!((a - b).abs() <= 1e-12 * truth.gram[0][0].abs(), "{what}");
        }
    }
}

#[test]
fn forced_routes_agree_on_a_conv_input_site() {
    for (seed, (what, conv)) in cases().into_iter().enumerate() {
        let batch = Batch::random(&conv, 100 + seed as u64);
        let trace = batch.conv_trace();
        let by = |route| Truth::from_trace_routed(trace.clone(), route, &|_, _, _| {}).unwrap();
        let (materialize, identity) = (by(GramRoute::Materialize), by(GramRoute::Identity));
        for i in 0..conv.batch {
            let want = batch.brute_norm(i);
            assert_rel(materialize.norms[i], want, what);
            assert_rel(identity.norms[i], want, what);
            for k in 0..conv.batch {
                let (a, b) = (materialize.gram[i][k], identity.gram[i][k]);
                assert!(
                    (a - b).abs() <= 1e-12 * materialize.gram[i][i].max(materialize.gram[k][k]),
                    "{what}: gram[{i}][{k}] {a:e} vs {b:e}"
                );
            }
        }
    }
}

/// The claim of a clipper that computed every norm exactly.
fn exact_claim(norms: &[f64]) -> Claim {
    Claim {
        norms: norms.to_vec(),
        coefficients: norms.iter().map(|n| (1.0 / n).min(1.0)).collect(),
        clipped_sum: None,
        clipping: Default::default(),
    }
}

#[test]
fn an_error_of_1e_3_in_one_input_value_fails_an_exact_claim() {
    let (_, conv) = cases().swap_remove(1);
    let batch = Batch::random(&conv, 7);
    let norms: Vec<f64> = (0..conv.batch).map(|i| batch.brute_norm(i)).collect();
    let claim = exact_claim(&norms);
    let verdict = |trace: RefTrace, precision: Precision| {
        Judge::from_trace(trace)
            .unwrap()
            .evaluate(
                "conv",
                &claim,
                ghost_oracle::ClipNorm::new(1.0).unwrap(),
                ghost_oracle::NoiseMultiplier::new(1.0).unwrap(),
                precision,
            )
            .unwrap()
            .verdict
    };
    // An f64 trace is judged at f64 (the exact claim of a conv-input trace exported in f64):
    // one input value off by 1e-3 moves example 1's norm far beyond its rounding bound.
    assert_eq!(verdict(batch.conv_trace(), Precision::F64), Verdict::Pass);
    let mut planted = batch.conv_trace();
    // Channel 0's first value of example 1 (read by some output position: checked below).
    let c = planted.sites[0].conv.as_mut().unwrap();
    c.inputs[(1, 0, 0)] += 1e-3;
    let moved = Truth::from_trace(planted.clone()).unwrap().norms[1];
    assert!(moved != norms[1], "the planted value is read");
    assert_ne!(
        verdict(planted, Precision::F64),
        Verdict::Pass,
        "a planted input error passed (norm {moved:e} against {:e})",
        norms[1]
    );
}

#[test]
fn a_conv_input_trace_round_trips_through_the_file_in_format_2_and_its_twin_in_format_1() {
    let dir = tmp("round-trip");
    for (seed, (what, conv)) in cases().into_iter().enumerate() {
        let batch = Batch::random(&conv, 200 + seed as u64);
        let norms: Vec<f64> = (0..conv.batch).map(|i| batch.brute_norm(i)).collect();
        let meta = TraceMeta::norms(1.0, norms.clone(), Precision::F64);
        let (path, twin_path) = (dir.join("conv.safetensors"), dir.join("twin.safetensors"));
        write_trace(&path, &batch.conv_trace(), &meta).unwrap();
        write_trace(&twin_path, &batch.unfolded_trace(), &meta).unwrap();
        assert_eq!(format_of(&path), "ghost-oracle-trace/2", "{what}");
        assert_eq!(format_of(&twin_path), "ghost-oracle-trace/1", "{what}");
        let (back, _) = read_trace(&path).unwrap();
        let c = back.sites[0].conv.as_ref().expect("read back as its input");
        assert_eq!(c.geometry, conv.geometry(), "{what}");
        assert_eq!(c.inputs, batch.inputs, "{what}");
        assert!(back.sites[0].activations.is_none(), "{what}");
        let truth = Truth::from_trace(back).unwrap();
        for (got, want) in truth.norms.iter().zip(&norms) {
            assert_rel(*got, *want, what);
        }
        // The file holds each input value once: smaller than its twin's unfolded patches
        // wherever the kernel has more than one tap.
        let (size, twin_size) = (file_len(&path), file_len(&twin_path));
        assert!(size < twin_size, "{what}: {size} vs {twin_size} bytes");
    }
}

#[test]
fn a_rounded_conv_input_trace_rounds_its_inputs_as_its_twin_rounds_its_patches() {
    let (what, conv) = cases().swap_remove(3);
    let batch = Batch::random(&conv, 300);
    let rounded = batch.conv_trace().rounded(Precision::BF16);
    let twin = batch.unfolded_trace().rounded(Precision::BF16);
    let c = rounded.sites[0].conv.as_ref().unwrap();
    for (r, x) in c.inputs.iter().zip(batch.inputs.iter()) {
        assert_eq!(*r, Precision::BF16.round(*x));
    }
    let (a, b) = (
        rounded.materialized_norms().unwrap(),
        twin.materialized_norms().unwrap(),
    );
    for (x, y) in a.iter().zip(&b) {
        assert_rel(x.total_sq, y.total_sq, what);
    }
}

// ---------------------------------------------------------------------------------------------
// Malformed conv-input traces, refused naming the site and tensor.

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "ghost-oracle-conv-input-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn file_len(p: &Path) -> u64 {
    std::fs::metadata(p).unwrap().len()
}

fn format_of(p: &Path) -> String {
    let bytes = std::fs::read(p).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    meta.metadata().as_ref().unwrap()["format"].clone()
}

/// A 2-D conv-input trace's header and tensors, written by hand so each can be spoiled: a
/// 3×3 kernel over 2 → 4 channels at 5×5, groups 2, padding 1, stride 2 (3×3 positions).
struct Raw {
    format: String,
    sites: serde_json::Value,
    tensors: Vec<(String, ArrayD<f64>)>,
}

impl Raw {
    fn good() -> Self {
        let (b, p) = (2, 9);
        let sites = serde_json::json!([
            {"name": "conv.weight", "param": "conv.weight", "kind": "linear",
             "conv": {"kernel": [3, 3], "stride": [2, 2], "dilation": [1, 1],
                      "padding": [[1, 1], [1, 1]], "groups": 2}},
            {"name": "conv.bias", "param": "conv.bias", "kind": "bias"}
        ]);
        let filled = |shape: &[usize]| {
            let mut k = 0.0;
            ArrayD::from_shape_simple_fn(IxDyn(shape), || {
                k += 1.0;
                (k * 0.37_f64).sin()
            })
        };
        Raw {
            format: "ghost-oracle-trace/2".into(),
            sites,
            tensors: vec![
                ("conv.weight.inputs".into(), filled(&[b, 2, 5, 5])),
                ("conv.weight.backprops".into(), filled(&[b, p, 4])),
                ("conv.bias.backprops".into(), filled(&[b, p, 4])),
                ("claimed.norms".into(), filled(&[b]).mapv(|v| v.abs() + 1.0)),
            ],
        }
    }

    fn conv(&mut self) -> &mut serde_json::Value {
        &mut self.sites[0]["conv"]
    }

    fn tensor(&mut self, name: &str) -> &mut ArrayD<f64> {
        &mut self
            .tensors
            .iter_mut()
            .find(|(n, _)| n == name)
            .expect("a tensor of the good trace")
            .1
    }

    fn write(&self, path: &Path) {
        let raw: Vec<(String, RawTensor)> = self
            .tensors
            .iter()
            .map(|(n, a)| (n.clone(), RawTensor::from_f64(&a.view(), Precision::F64)))
            .collect();
        let meta = HashMap::from([
            ("format".to_string(), self.format.clone()),
            ("max_grad_norm".to_string(), "1.0".to_string()),
            ("sites".to_string(), self.sites.to_string()),
        ]);
        write_raw(path, &raw, Some(meta)).unwrap();
    }

    fn read(&self) -> ghost_oracle_reference::Result<RefTrace> {
        let path = tmp("raw").join("trace.safetensors");
        self.write(&path);
        let bytes = std::fs::read(&path).unwrap();
        read_trace_bytes(&bytes, "t.safetensors").map(|(t, _)| t)
    }
}

#[test]
fn the_hand_written_conv_input_trace_reads_and_matches_its_formula() {
    let trace = Raw::good().read().unwrap();
    assert_eq!(trace.site_gradient_shape(0), (4, 9));
    assert_eq!(trace.sites[0].row_count(), 18);
    let norms = Truth::from_trace(trace).unwrap().norms;
    assert!(norms.iter().all(|n| n.is_finite() && *n > 0.0));
}

#[test]
fn every_malformed_conv_input_site_is_refused_naming_it() {
    type Spoil = Box<dyn Fn(&mut Raw)>;
    let cases: Vec<(Spoil, &[&str])> = vec![
        (
            Box::new(|r| r.format = "ghost-oracle-trace/1".into()),
            &["site `conv.weight` carries `conv`", "ghost-oracle-trace/2"],
        ),
        (
            Box::new(|r| {
                let conv = r.conv().clone();
                r.sites[1]["conv"] = conv;
            }),
            &["site `conv.bias` (bias) carries `conv`", "linear"],
        ),
        (
            Box::new(|r| {
                // 3 channels in 2 groups.
                *r.tensor("conv.weight.inputs") = ArrayD::zeros(IxDyn(&[2, 3, 5, 5]));
            }),
            &[
                "site `conv.weight`",
                "`conv.weight.inputs` has 3 channels",
                "groups",
            ],
        ),
        (
            Box::new(|r| {
                *r.tensor("conv.weight.backprops") = ArrayD::zeros(IxDyn(&[2, 9, 5]));
                *r.tensor("conv.bias.backprops") = ArrayD::zeros(IxDyn(&[2, 9, 5]));
            }),
            &[
                "site `conv.weight`",
                "`conv.weight.backprops` has 5 output channels",
                "groups",
            ],
        ),
        (
            Box::new(|r| r.conv()["stride"] = serde_json::json!([1, 2])),
            &[
                "site `conv.weight`",
                "`conv.weight.backprops` has 9 rows",
                "15 output positions",
            ],
        ),
        (
            Box::new(|r| {
                r.conv()["kernel"] = serde_json::json!([9, 3]);
            }),
            &["site `conv.weight`", "O_0 < 1"],
        ),
        (
            Box::new(|r| r.conv()["kernel"] = serde_json::json!([0, 3])),
            &["site `conv.weight`", "`conv.kernel`", "found 0"],
        ),
        (
            Box::new(|r| r.conv()["padding"] = serde_json::json!([[-1, 1], [1, 1]])),
            &["site `conv.weight`", "`conv.padding`", "found -1"],
        ),
        (
            Box::new(|r| r.conv()["dilation"] = serde_json::json!([1, 1, 1])),
            &[
                "site `conv.weight`",
                "`kernel` has 2 spatial axes but dilation has 3",
            ],
        ),
        (
            Box::new(|r| r.conv()["groups"] = serde_json::json!(0)),
            &["site `conv.weight`", "`conv.groups`", "found 0"],
        ),
        (
            Box::new(|r| r.conv()["mode"] = serde_json::json!("reflect")),
            &["site `conv.weight`", "unknown key `mode`"],
        ),
        (
            Box::new(|r| {
                r.tensors.push((
                    "conv.weight.activations".into(),
                    ArrayD::zeros(IxDyn(&[2, 18, 18])),
                ));
            }),
            &[
                "site `conv.weight`",
                "tensor `conv.weight.activations` is given",
            ],
        ),
        (
            Box::new(|r| r.tensors.retain(|(n, _)| n != "conv.weight.inputs")),
            &[
                "site `conv.weight`",
                "tensor `conv.weight.inputs` is missing",
            ],
        ),
        (
            Box::new(|r| {
                *r.tensor("conv.weight.inputs") = ArrayD::zeros(IxDyn(&[2, 2, 25]));
            }),
            &[
                "site `conv.weight`",
                "tensor `conv.weight.inputs` has shape [2, 2, 25]",
            ],
        ),
        (
            Box::new(|r| {
                *r.tensor("conv.weight.inputs") = ArrayD::zeros(IxDyn(&[3, 2, 5, 5]));
            }),
            &[
                "site `conv.weight`",
                "`conv.weight.inputs` holds 3 examples",
            ],
        ),
    ];
    for (k, (spoil, needles)) in cases.into_iter().enumerate() {
        let mut raw = Raw::good();
        spoil(&mut raw);
        let e = raw
            .read()
            .expect_err(&format!("case {k}: {needles:?} read"))
            .to_string();
        for n in needles {
            assert!(e.contains(n), "case {k}: message lacks {n:?}: {e}");
        }
        assert!(e.contains("t.safetensors"), "case {k}: {e}");
    }
}

#[test]
fn check_exits_2_on_a_conv_entry_in_a_format_1_trace_and_judges_a_format_2_one() {
    let dir = tmp("cli");
    let bin = env!("CARGO_BIN_EXE_ghost-oracle");
    let good = dir.join("good.safetensors");
    let batch = Batch::random(&cases().swap_remove(1).1, 400);
    let norms: Vec<f64> = (0..batch.conv.batch).map(|i| batch.brute_norm(i)).collect();
    write_trace(
        &good,
        &batch.conv_trace(),
        &TraceMeta::norms(1.0, norms, Precision::F64),
    )
    .unwrap();
    let o = Command::new(bin)
        .args(["check", good.to_str().unwrap(), "--gate"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");

    let bad = dir.join("bad.safetensors");
    let mut raw = Raw::good();
    raw.format = "ghost-oracle-trace/1".into();
    raw.write(&bad);
    let o = Command::new(bin)
        .args(["check", bad.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains("site `conv.weight` carries `conv`"), "{err}");
}

#[test]
fn the_memory_budget_counts_one_examples_unfolded_tile_before_reading() {
    // One channel at 64×64 under a 9×9 kernel: ~100 KB of inputs a batch, but 4096 × 81
    // values (2.5 MiB) in one example's unfolded tile.
    let mut conv = Conv::plain(1, 1, &[9, 9], &[64, 64]);
    conv.padding = vec![(4, 4), (4, 4)];
    let batch = Batch::random(&conv, 500);
    let path = tmp("budget").join("trace.safetensors");
    let norms = vec![1.0; conv.batch];
    write_trace(
        &path,
        &batch.conv_trace(),
        &TraceMeta::norms(1.0, norms, Precision::F64),
    )
    .unwrap();
    let bytes = std::fs::read(&path).unwrap();
    assert!(bytes.len() < 1 << 20, "{} bytes", bytes.len());
    let e = read_trace_bytes_within(&bytes, "t.safetensors", MemoryBudget::bytes(2 << 20))
        .unwrap_err()
        .to_string();
    assert!(e.contains("site `conv.weight`"), "{e}");
    read_trace_bytes_within(&bytes, "t.safetensors", MemoryBudget::bytes(8 << 20)).unwrap();
}

#[test]
fn a_clippers_device_trace_of_a_conv_input_site_holds_its_unfolded_twins_rows() {
    use candle_core::{DType, Device};
    for (seed, (what, conv)) in cases().into_iter().enumerate() {
        let batch = Batch::random(&conv, 600 + seed as u64);
        let device =
            ghost_oracle::Trace::from_reference(&batch.conv_trace(), DType::F64, &Device::Cpu)
                .unwrap();
        let back = device.to_reference().unwrap();
        let twin = batch.unfolded_trace();
        for (got, want) in back.sites.iter().zip(&twin.sites) {
            assert!(got.conv.is_none(), "{what}");
            assert_eq!(got.activations, want.activations, "{what}");
            assert_eq!(got.backprops, want.backprops, "{what}");
        }
    }
}
