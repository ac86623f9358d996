//! The streamed reference (norms taken block by block, the head's gradient a vocabulary chunk
//! at a time, blocks kept in the checkpoint's dtype) against the materialized one: the same
//! norms, splits, losses and trace for every family, tied and untied, and bit-identical results
//! whether the blocks are resident in f64 or stored in f32 / bf16 and widened.

mod common;

use common::close;
use ghost_oracle_reference::*;
use ndarray::array;
use std::path::PathBuf;

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("go-ref-streamed-{tag}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    dir
}

fn batch() -> Batch {
    // Example 0 repeats tokens 3 and 5; example 1 masks two targets and repeats 4.
    let ids = array![[3_i64, 5, 7, 3, 5, 1, 9, 2], [4, 4, 0, 10, 2, 6, 4, 8]];
    let labels = array![
        [3_i64, 5, 7, 3, 5, 1, 9, 2],
        [4, 4, -100, 10, 2, -100, 4, 8]
    ];
    Batch::new(ids, Some(labels)).unwrap()
}

fn models() -> Vec<(&'static str, Model)> {
    let mut qwen3 = LlamaConfig::tiny(LlamaFlavor::Qwen3, 11, 12, 2, 4, 2);
    qwen3.head_dim = 8;
    let mut gemma2 = LlamaConfig::tiny(LlamaFlavor::Gemma2, 11, 12, 2, 2, 1).untied();
    gemma2.head_dim = 8;
    gemma2.final_logit_softcapping = Some(2.0);
    gemma2.attn_logit_softcapping = Some(1.5);
    let mut qwen2 = LlamaConfig::tiny(LlamaFlavor::Qwen2, 11, 16, 2, 4, 1);
    qwen2.rope_theta = 1e6;
    vec![
        (
            "gpt2 tied",
            Gpt2::random(Gpt2Config::tiny(11, 8, 8, 2, 2), 1, 0.4).into(),
        ),
        (
            "gpt2 untied",
            Gpt2::random(Gpt2Config::tiny(11, 8, 8, 2, 2).untied(), 2, 0.4).into(),
        ),
        ("qwen3 tied", Llama::random(qwen3, 3, 0.4).into()),
        (
            "gemma2 untied, soft-capped",
            Llama::random(gemma2, 4, 0.5).into(),
        ),
        ("qwen2 tied, biases", Llama::random(qwen2, 5, 0.4).into()),
    ]
}

#[test]
fn streamed_norms_equal_the_materialized_gradients_norms() {
    for (name, model) in models() {
        let run = |keep_gradients| {
            let opts = Options {
                record_trace: true,
                keep_gradients,
                ..Options::default()
            };
            compute(&model, &batch(), &opts, &mut |_| {}).unwrap()
        };
        let (streamed, full) = (run(false), run(true));
        assert_eq!(streamed.layout, full.layout, "{name}");
        assert_eq!(streamed.examples.len(), 2);
        for (s, f) in streamed.examples.iter().zip(&full.examples) {
            assert_eq!(s.loss, f.loss, "{name}: the forward pass is the same");
            assert!(
                close(s.norm, f.norm, 1e-12),
                "{name}: {} vs {}",
                s.norm,
                f.norm
            );
            assert_eq!(s.params.len(), f.params.len(), "{name}");
            for ((sn, sv), (fname, fv)) in s.params.iter().zip(&f.params) {
                assert_eq!(sn, fname, "{name}: checkpoint order");
                assert!(close(*sv, *fv, 1e-12), "{name} {sn}: {sv} vs {fv}");
            }
            assert_eq!(s.shared.len(), f.shared.len(), "{name}");
            for ((_, a), (_, b)) in s.shared.iter().zip(&f.shared) {
                assert!(close(a.input_sq, b.input_sq, 1e-12), "{name}");
                assert!(close(a.output_sq, b.output_sq, 1e-12), "{name}");
                // The cross term is a difference of larger terms: compared on their scale.
                let scale = (a.input_sq * a.output_sq).sqrt();
                assert!((a.cross - b.cross).abs() <= 1e-12 * scale, "{name}");
            }
        }
        // The sites are the same computation in either path.
        assert_eq!(
            format!("{:?}", streamed.trace),
            format!("{:?}", full.trace),
            "{name}"
        );
        // The one gradient the streamed path never forms is summed from its factors instead.
        let from_trace = streamed.trace.unwrap().materialized_norms().unwrap();
        for (m, e) in from_trace.iter().zip(&streamed.examples) {
            assert!(close(m.total_sq.sqrt(), e.norm, 1e-10), "{name}");
        }
    }
}

/// A checkpoint of `model` with every tensor in `precision`.
fn write(model: &Llama, dir: &std::path::Path, precision: Precision) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string(&model.config.to_json()).unwrap(),
    )
    .unwrap();
    let mut raw = Vec::new();
    model.visit_weights(&mut |name, t| raw.push((name, RawTensor::from_f64(&t, precision))));
    write_raw(&dir.join("model.safetensors"), &raw, None).unwrap();
}

#[test]
fn stored_blocks_give_the_resident_models_results_bit_for_bit() {
    let mut cfg = LlamaConfig::tiny(LlamaFlavor::Qwen3, 11, 12, 3, 4, 2);
    cfg.head_dim = 8;
    let model = Llama::random(cfg, 7, 0.4);
    for precision in [Precision::F32, Precision::BF16, Precision::F64] {
        let dir = temp_dir(precision.name());
        write(&model, &dir, precision);
        let stored: Llama = load(&dir).unwrap();
        let resident: Llama = load_resident(&dir).unwrap();
        let blocks = stored
            .stored
            .as_ref()
            .expect("a loaded Llama stores its blocks");
        assert_eq!(blocks.layers(), 3);
        // Left in the file's mapping, not copied.
        assert!(blocks.mapped());
        assert!(stored.params.layers.is_empty() && resident.stored.is_none());
        // The stored values take the checkpoint's width, not f64's.
        let weights: usize = resident
            .params
            .layers
            .iter()
            .map(|l| l.tensors().iter().map(|(_, t)| t.len()).sum::<usize>())
            .sum();
        assert_eq!(
            blocks.bytes(),
            weights * precision.stored().bitsize() / 8,
            "{precision:?}"
        );
        let opts = Options {
            record_trace: true,
            ..Options::default()
        };
        let a = compute(&stored, &batch(), &opts, &mut |_| {}).unwrap();
        let b = compute(&resident, &batch(), &opts, &mut |_| {}).unwrap();
        for (x, y) in a.examples.iter().zip(&b.examples) {
            assert_eq!((x.loss, x.norm), (y.loss, y.norm), "{precision:?}");
            assert_eq!(x.params, y.params, "{precision:?}");
        }
        assert_eq!(format!("{:?}", a.trace), format!("{:?}", b.trace));
        // Every weight read back is the resident model's, and saving a stored model writes all
        // of them.
        let mut from_stored = Vec::new();
        stored.visit_weights(&mut |n, t| from_stored.push((n, t.to_owned())));
        let mut from_resident = Vec::new();
        resident.visit_weights(&mut |n, t| from_resident.push((n, t.to_owned())));
        assert_eq!(from_stored, from_resident, "{precision:?}");
        assert_eq!(from_stored.len(), DecoderModel::layout(&stored).len());
        std::fs::remove_dir_all(&dir).ok();
    }
}

#[test]
fn examples_run_through_the_blocks_together_give_each_examples_results_bit_for_bit() {
    let mut cfg = LlamaConfig::tiny(LlamaFlavor::Llama, 11, 12, 3, 4, 2);
    cfg.head_dim = 6;
    let model = Llama::random(cfg, 11, 0.4);
    let dir = temp_dir("together");
    write(&model, &dir, Precision::F32);
    let stored: Llama = load(&dir).unwrap();
    let ids = array![
        [3_i64, 5, 7, 3, 5, 1],
        [4, 4, 0, 10, 2, 6],
        [9, 8, 7, 6, 5, 4]
    ];
    let batch = Batch::new(ids, None).unwrap();
    let run = |together| {
        let opts = Options {
            record_trace: true,
            together: Some(together),
            ..Options::default()
        };
        let mut seen = Vec::new();
        let r = compute(&stored, &batch, &opts, &mut |p| seen.push(p)).unwrap();
        (r, seen)
    };
    let (alone, _) = run(1);
    for together in [2, 3, 5] {
        let (r, seen) = run(together);
        for (x, y) in r.examples.iter().zip(&alone.examples) {
            assert_eq!((x.loss, x.norm), (y.loss, y.norm), "{together} together");
            assert_eq!(x.params, y.params, "{together} together");
            assert_eq!(format!("{:?}", x.shared), format!("{:?}", y.shared));
        }
        assert_eq!(format!("{:?}", r.trace), format!("{:?}", alone.trace));
        // Progress counts every example's passes once, in order, to the end.
        let steps: Vec<(usize, usize)> = seen.iter().map(|p| p.steps()).collect();
        assert!(
            steps.windows(2).all(|w| w[0].0 < w[1].0),
            "{together} together: {steps:?}"
        );
        assert_eq!(steps.last(), Some(&(3 * 7, 3 * 7)), "{together} together");
        let group = together.min(3);
        assert_eq!(
            seen[0].describe(),
            format!("examples 1–{group}/3, block 1/3 forward")
        );
        assert_eq!(seen[3].describe(), format!("examples 1–{group}/3, heads"));
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_stored_non_finite_weight_is_an_error_naming_the_tensor() {
    let mut cfg = LlamaConfig::tiny(LlamaFlavor::Llama, 11, 8, 2, 2, 1);
    cfg.head_dim = 4;
    let mut model = Llama::random(cfg, 8, 0.4);
    model.params.layers[1].up_proj.weight[(2, 1)] = f64::NAN;
    let dir = temp_dir("nan");
    write(&model, &dir, Precision::BF16);
    let err = load::<Llama>(&dir).unwrap_err().to_string();
    assert!(
        err.contains("model.layers.1.mlp.up_proj.weight") && err.contains("non-finite"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_checkpoint_whose_header_overruns_the_file_is_an_error_naming_it() {
    let model = Llama::random(
        LlamaConfig::tiny(LlamaFlavor::Llama, 11, 8, 1, 2, 1),
        9,
        0.4,
    );
    let dir = temp_dir("short");
    write(&model, &dir, Precision::F32);
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    // Truncated: the tensors no longer fit.
    std::fs::write(&path, &bytes[..bytes.len() - 10]).unwrap();
    let err = load::<Llama>(&dir).unwrap_err().to_string();
    assert!(
        err.contains("model.safetensors") && err.contains("not a valid safetensors"),
        "{err}"
    );
    // A header length larger than the file.
    let mut huge = bytes.clone();
    huge[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    std::fs::write(&path, &huge).unwrap();
    let err = load::<Llama>(&dir).unwrap_err().to_string();
    assert!(err.contains("header of 1099511627776 bytes"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn progress_reports_every_block_pass_of_every_example() {
    let model = Llama::random(
        LlamaConfig::tiny(LlamaFlavor::Llama, 11, 8, 3, 2, 1),
        10,
        0.4,
    );
    let mut seen = Vec::new();
    compute(&model, &batch(), &Options::default(), &mut |p| seen.push(p)).unwrap();
    // 3 blocks forward, the head, 2 blocks backward, then the example's end (its last block):
    // 7 an example.
    assert_eq!(seen.len(), 2 * 7);
    let steps: Vec<(usize, usize)> = seen.iter().map(|p| p.steps()).collect();
    assert_eq!(steps, (1..=14).map(|s| (s, 14)).collect::<Vec<_>>());
    let described: Vec<String> = seen[..8].iter().map(|p| p.describe()).collect();
    assert_eq!(
        described,
        [
            "example 1/2, block 1/3 forward",
            "example 1/2, block 2/3 forward",
            "example 1/2, block 3/3 forward",
            "example 1/2, head",
            "example 1/2, block 3/3 backward",
            "example 1/2, block 2/3 backward",
            "1/2 examples",
            "example 2/2, block 1/3 forward",
        ]
    );
    assert_eq!(seen[13].describe(), "2/2 examples");
}
