//! The reference checked against two independent computations: central finite differences of
//! its own forward pass, and PyTorch (torch.func per-example gradients) golden files.

mod common;

use common::{assert_trace_gives_the_reported_norms, check_finite_differences, close};
use ghost_oracle_reference::*;
use ndarray::{array, Array2};
use std::path::{Path, PathBuf};

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("golden/cases")
}

fn fd_batch() -> Batch {
    // Repeated tokens (3 and 5) and a target (5) that is also an input.
    Batch::new(array![[3_i64, 5, 7, 3, 5, 1, 9]], None).unwrap()
}

#[test]
fn finite_differences_tied_two_layers() {
    let model = Gpt2::random(Gpt2Config::tiny(11, 8, 8, 2, 2), 1, 0.4);
    check_finite_differences(&model, &fd_batch());
}

#[test]
fn finite_differences_untied_two_layers() {
    let model = Gpt2::random(Gpt2Config::tiny(11, 8, 8, 2, 4).untied(), 2, 0.4);
    check_finite_differences(&model, &fd_batch());
}

#[test]
fn finite_differences_with_ignored_labels() {
    let model = Gpt2::random(Gpt2Config::tiny(11, 8, 6, 1, 3), 3, 0.5);
    let ids = array![[3_i64, 5, 7, 3, 5, 1, 9]];
    let labels = array![[3_i64, -100, 7, -100, 5, 1, -100]];
    check_finite_differences(&model, &Batch::new(ids, Some(labels)).unwrap());
}

#[test]
fn finite_differences_inverse_layer_idx_scaling() {
    let mut cfg = Gpt2Config::tiny(11, 8, 8, 2, 2);
    cfg.scale_attn_by_inverse_layer_idx = true;
    check_finite_differences(&Gpt2::random(cfg, 4, 0.4), &fd_batch());
}

#[test]
fn matches_pytorch_golden_files() {
    let mut cases = 0;
    let mut tied_cases = 0;
    let mut families = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(golden_dir()).expect("golden cases present") {
        let dir = entry.unwrap().path();
        let expected: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap())
                .unwrap();
        // Every case loads through the family dispatch, and the family is the one its name says.
        let model = load::<Model>(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        // The family is the name's first word (`llama3` is Llama with llama3 rope scaling).
        let family = match name.split('_').next().unwrap() {
            "llama" | "llama3" => "llama",
            "gemma3" => "gemma3_text",
            "qwen2" => "qwen2",
            "qwen3" => "qwen3",
            "gemma" => "gemma",
            "gemma2" => "gemma2",
            "vaultgemma" => "vaultgemma",
            _ => "gpt2",
        };
        assert_eq!(model.model_type(), family, "{name}");
        *families.entry(family).or_insert(0) += 1;
        let batch = Batch::load(&dir.join("batch.safetensors")).unwrap();
        let reduction = match expected["reduction"].as_str().unwrap() {
            "sum" => Reduction::Sum,
            _ => Reduction::Mean,
        };
        let opts = Options {
            reduction,
            ..Options::default()
        };
        let r = compute(&model, &batch, &opts, &mut |_| {}).unwrap();
        let ex = expected["examples"].as_array().unwrap();
        assert_eq!(ex.len(), r.examples.len());
        for (i, (got, want)) in r.examples.iter().zip(ex).enumerate() {
            let ctx = format!("{} example {i}", dir.display());
            assert!(
                close(got.loss, want["loss"].as_f64().unwrap(), 1e-9),
                "{ctx}: loss {} vs {}",
                got.loss,
                want["loss"]
            );
            assert!(
                close(got.norm, want["norm"].as_f64().unwrap(), 1e-9),
                "{ctx}: norm {} vs {}",
                got.norm,
                want["norm"]
            );
            let want_params = want["params"].as_object().unwrap();
            assert_eq!(
                want_params.len(),
                got.params.len(),
                "{ctx}: parameter count"
            );
            for (name, v) in &got.params {
                let w = want_params
                    .get(name)
                    .unwrap_or_else(|| panic!("{ctx}: no golden norm for {name}"));
                assert!(
                    close(*v, w.as_f64().unwrap(), 1e-9),
                    "{ctx}: {name} norm {v} vs {w}"
                );
            }
            let want_shared = want["shared"].as_object().unwrap();
            assert_eq!(
                want_shared.len(),
                got.shared.len(),
                "{ctx}: shared parameters"
            );
            for (name, s) in &got.shared {
                let w = &want_shared[name];
                // The cross term is compared relative to the norm it enters, since it can be ~0.
                let scale = s.input_sq + s.output_sq;
                for (v, key) in [
                    (s.input_sq, "input_sq"),
                    (s.output_sq, "output_sq"),
                    (s.cross, "cross"),
                ] {
                    let wv = w[key].as_f64().unwrap();
                    assert!(
                        (v - wv).abs() <= 1e-9 * scale.max(wv.abs()),
                        "{ctx}: {name}.{key} {v} vs {wv}"
                    );
                }
                tied_cases += 1;
            }
        }
        cases += 1;
    }
    assert!(cases >= 28 && tied_cases > 0, "{cases} golden cases found");
    let want = [
        ("gpt2", 9),
        ("llama", 6),
        ("qwen2", 2),
        ("qwen3", 3),
        ("gemma", 2),
        ("gemma2", 2),
        ("gemma3_text", 2),
        ("vaultgemma", 2),
    ];
    for (family, n) in want {
        assert!(families.get(family) >= Some(&n), "{family}: {families:?}");
    }
}

#[test]
fn tied_split_adds_up_and_cross_term_is_not_negligible() {
    let model = Gpt2::random(Gpt2Config::tiny(13, 16, 8, 1, 2), 5, 0.5);
    let batch = Batch::new(array![[1_i64, 2, 1, 3, 2, 1, 4, 5, 6, 2]], None).unwrap();
    let r = compute(&model, &batch, &Options::default(), &mut |_| {}).unwrap();
    let e = &r.examples[0];
    let (_, s) = e.shared[0];
    let wte = e
        .params
        .iter()
        .find(|(n, _)| n == "transformer.wte.weight")
        .unwrap()
        .1;
    let identity = s.input_sq + s.output_sq + 2.0 * s.cross;
    assert!((wte * wte - identity).abs() <= 1e-13 * identity);
    let total_sq: f64 = e.params.iter().map(|(_, v)| v * v).sum();
    assert!((e.norm * e.norm - total_sq).abs() <= 1e-13 * total_sq);
    assert!(
        (2.0 * s.cross).abs() > 1e-3 * e.norm * e.norm,
        "cross term {} too small to test anything",
        s.cross
    );
}

#[test]
fn trace_rebuilds_the_materialized_gradients() {
    // The recorded factors, materialized site by site and summed per parameter, must give the
    // very norms of the explicit backward pass: a wrong activation or backprop would not.
    for model in [
        Gpt2::random(Gpt2Config::tiny(13, 16, 8, 2, 2), 6, 0.5),
        Gpt2::random(Gpt2Config::tiny(13, 16, 8, 1, 4).untied(), 7, 0.5),
    ] {
        let batch = Batch::new(array![[1_i64, 2, 1, 3, 2, 1], [4, 4, 4, 0, 12, 11]], None).unwrap();
        let opts = Options {
            record_trace: true,
            ..Options::default()
        };
        let r = compute(&model, &batch, &opts, &mut |_| {}).unwrap();
        assert_trace_gives_the_reported_norms(&r, "GPT-2");
    }
}

#[test]
fn checkpoint_round_trip_in_both_precisions() {
    let dir = std::env::temp_dir().join(format!("go-ref-rt-{}", std::process::id()));
    let model = Gpt2::random(Gpt2Config::tiny(9, 6, 4, 1, 2).untied(), 8, 0.3);
    model.save(&dir, false).unwrap();
    assert_eq!(load::<Gpt2>(&dir).unwrap(), model);
    model.save(&dir, true).unwrap();
    let back = load::<Gpt2>(&dir).unwrap();
    let err = (&back.params.wte - &model.params.wte)
        .iter()
        .fold(0.0_f64, |a, v| a.max(v.abs()));
    assert!(err > 0.0 && err < 1e-7, "f32 round trip error {err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn kept_gradients_have_the_reported_norms_and_the_model_layout() {
    let model = Gpt2::random(Gpt2Config::tiny(9, 6, 4, 1, 2), 9, 0.3);
    let batch = Batch::new(array![[1_i64, 2, 3], [3, 2, 1]], None).unwrap();
    let opts = Options {
        keep_gradients: true,
        ..Options::default()
    };
    let r = compute(&model, &batch, &opts, &mut |_| {}).unwrap();
    let kept = r.gradients.as_ref().unwrap();
    for (i, g) in kept.iter().enumerate() {
        let sq: f64 = g.iter().map(|v| v * v).sum();
        assert!(close(sq.sqrt(), r.examples[i].norm, 1e-12));
        assert_eq!(g.len(), model.config.parameter_count());
    }
    let n: usize = r
        .layout
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    assert_eq!(n, model.config.parameter_count());
    let _: Array2<f64> = Array2::zeros((1, 1));
}

#[test]
fn gradient_rows_of_every_site_kind_add_up_to_the_weighted_whole_in_any_partition() {
    // A tied GPT-2 (embedding, conv1d, bias, layernorm and linear head sites; repeated ids) on
    // three examples. For weights w, Σ over a partition of the rows of add_site_gradient_rows
    // must rebuild Σ_i w_i · site_gradient(j, i), each row block in its place; an example of
    // weight 0 contributes nothing.
    let model = Gpt2::random(Gpt2Config::tiny(9, 6, 4, 1, 2), 5, 0.4);
    let batch = Batch::new(array![[1_i64, 2, 1, 8], [3, 3, 0, 8], [8, 7, 6, 5]], None).unwrap();
    let opts = Options {
        record_trace: true,
        ..Options::default()
    };
    let trace = compute(&model, &batch, &opts, &mut |_| {})
        .unwrap()
        .trace
        .unwrap();
    let kinds: std::collections::BTreeSet<&str> =
        trace.sites.iter().map(|s| s.spec.kind.name()).collect();
    assert_eq!(kinds.len(), 5, "{kinds:?}");
    let weights = [0.5, 0.0, -2.0];
    for j in 0..trace.sites.len() {
        let (rows, cols) = trace.site_gradient_shape(j);
        let mut want = Array2::zeros((rows, cols));
        for (i, w) in weights.iter().enumerate() {
            let g = trace.site_gradient(j, i).unwrap();
            assert_eq!(g.dim(), (rows, cols), "site {j}");
            want.scaled_add(*w, &g);
        }
        for step in [1, 2, 3, rows] {
            let mut got = Array2::zeros((rows, cols));
            let mut start = 0;
            while start < rows {
                let end = (start + step).min(rows);
                let mut block = Array2::zeros((end - start, cols));
                trace
                    .add_site_gradient_rows(j, &weights, start..end, &mut block)
                    .unwrap();
                got.slice_mut(ndarray::s![start..end, ..]).assign(&block);
                start = end;
            }
            let scale = want.iter().fold(0.0_f64, |a, v| a.max(v.abs()));
            assert!(scale > 0.0, "site {j}");
            for (a, b) in got.iter().zip(want.iter()) {
                assert!(
                    (a - b).abs() <= 1e-13 * scale,
                    "site {} ({}), blocks of {step}: {a} vs {b}",
                    trace.sites[j].spec.name,
                    trace.sites[j].spec.kind.name()
                );
            }
        }
    }
}

#[test]
fn a_batch_is_checked_when_built_and_against_the_model_it_runs_on() {
    let err = |r: Result<Batch>| r.unwrap_err().to_string();
    let msg = err(Batch::new(array![[1_i64, -3, 2]], None));
    assert!(msg.contains("input_ids[0][1] = -3"), "{msg}");
    let msg = err(Batch::new(
        array![[1_i64, 2, 3]],
        Some(array![[1_i64, -7, 3]]),
    ));
    assert!(
        msg.contains("labels[0][1] = -7") && msg.contains("-100"),
        "{msg}"
    );
    let msg = err(Batch::new(array![[1_i64, 2, 3]], Some(array![[1_i64, 2]])));
    assert!(msg.contains("`labels` has shape [1, 2]"), "{msg}");
    // Ignored labels are kept; a batch is changed through its parts and checked again.
    let b = Batch::new(array![[1_i64, 2, 3]], Some(array![[1_i64, IGNORE, 3]])).unwrap();
    assert_eq!(b.targets(0), vec![(1, 3)]);
    let (mut ids, labels) = b.into_parts();
    ids[(0, 2)] = 11;
    let b = Batch::new(ids, Some(labels)).unwrap();
    assert_eq!(b.input_ids()[(0, 2)], 11);

    // Id 11 is outside the 11-row table: every public entry point refuses it, none panics.
    let model = Gpt2::random(Gpt2Config::tiny(11, 8, 8, 1, 2), 1, 0.4);
    let msg = err(example_gradient(&model, &b, 0, Reduction::Mean, true).map(|_| b.clone()));
    assert!(msg.contains("input_ids[0][2] = 11"), "{msg}");
    let mut g = model.zero_gradient();
    let r = example_gradient_into(
        &model,
        &b,
        0,
        Reduction::Sum,
        false,
        HeadPath::Folded,
        &mut g,
    );
    assert!(r.is_err());
    assert!(example_loss(&model, &b, 0, Reduction::Mean).is_err());
    let msg =
        err(example_gradient(&model, &fd_batch(), 1, Reduction::Mean, false).map(|_| b.clone()));
    assert!(msg.contains("example 1 is outside the batch"), "{msg}");
    let long = Batch::new(Array2::from_elem((1, 9), 1_i64), None).unwrap();
    let msg = err(example_gradient(&model, &long, 0, Reduction::Mean, false).map(|_| b.clone()));
    assert!(msg.contains("n_positions = 8"), "{msg}");
    let opts = Options::default();
    assert!(compute(&model, &b, &opts, &mut |_| {}).is_err());
}
