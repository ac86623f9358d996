//! The candle models (autograd) against the reference (hand-written backward): GPT-2, Llama,
//! Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3 and VaultGemma; `audit --model` on HF checkpoints of the
//! newer families.

use crate::common::*;
use candle_core::{DType, Device, Tensor};
use ghost_oracle::model::{CandleGpt2, CandleModel};
use ghost_oracle::trace::SiteSpec;
use ghost_oracle::*;
use ghost_oracle_reference::{
    Batch, LayerType, Llama, LlamaConfig, LlamaFlavor, Model, Reduction, RopeScaling, SiteKind,
    EMBED_TOKENS,
};

fn max_rel(a: &Tensor, b: &ndarray::ArrayD<f64>) -> f64 {
    let a: Vec<f64> = a
        .to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0_f64, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b.iter())
        .fold(0.0_f64, |m, (x, y)| m.max((x - y).abs() / scale))
}

crate::device_test!(
    candle_trace_and_batch_gradient_match_the_reference,
    |device| {
        for (tied, reduction) in [(true, Reduction::Mean), (false, Reduction::Sum)] {
            let model = tiny(tied, 2, 11);
            let (ids, mut labels) = batch(3, 7, 23, 12).into_parts();
            labels[(1, 3)] = ghost_oracle_reference::IGNORE;
            let b = Batch::new(ids, Some(labels)).unwrap();
            let r = assert_matches_reference("gpt2", &model.clone().into(), &b, reduction, device);
            // The family type on its own computes the same thing as through `CandleModel`.
            let ex = CandleGpt2::from_reference(&model, DType::F64, device)
                .unwrap()
                .extract(&b, reduction)
                .unwrap();
            for (i, e) in r.examples.iter().enumerate() {
                assert!(
                    (ex.losses[i] - e.loss).abs() < 1e-12 * e.loss.abs(),
                    "loss {i}"
                );
            }
            let rt = r.trace.as_ref().unwrap();
            assert_eq!(count_kind(rt, SiteKind::Embedding), 2);
            assert_eq!(count_kind(rt, SiteKind::Conv1d), 2 * 4);
        }
    }
);

/// Every site's spec, ids, backprops and activations, the batch gradient and the per-example
/// losses of the candle model equal the reference's: to `1e-12` relative in f64 and `1e-5` in
/// f32. Returns the reference.
fn assert_matches_reference(
    label: &str,
    model: &Model,
    b: &Batch,
    reduction: Reduction,
    device: &Device,
) -> ghost_oracle_reference::Reference {
    assert_matches_reference_at(label, model, b, reduction, device, 1e-5)
}

/// [`assert_matches_reference`] with `f32_tol` for the f32 run.
fn assert_matches_reference_at(
    label: &str,
    model: &Model,
    b: &Batch,
    reduction: Reduction,
    device: &Device,
    f32_tol: f64,
) -> ghost_oracle_reference::Reference {
    let opts = ghost_oracle_reference::Options {
        record_trace: true,
        keep_gradients: true,
        reduction,
        ..Default::default()
    };
    let r = ghost_oracle_reference::compute(model, b, &opts, &mut |_| {}).unwrap();
    let rt = r.trace.as_ref().unwrap();
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, f32_tol)] {
        let ex = CandleModel::from_reference(model, dtype, device)
            .unwrap()
            .extract(b, reduction)
            .unwrap();
        let names =
            |sites: Vec<&SiteSpec>| sites.iter().map(|s| s.name.clone()).collect::<Vec<_>>();
        assert_eq!(
            names(ex.trace.sites.iter().map(|s| &s.spec).collect()),
            names(rt.sites.iter().map(|s| &s.spec).collect()),
            "{label}: site names and order"
        );
        for (c, o) in ex.trace.sites.iter().zip(&rt.sites) {
            assert_eq!(c.spec, o.spec, "{label}");
            assert_eq!(c.backprops.dtype(), dtype, "{label} site {}", c.spec.name);
            let e = max_rel(&c.backprops, &o.backprops.clone().into_dyn());
            assert!(
                e < tol,
                "{label} {dtype:?} site {}: backprops differ by {e:e}",
                c.spec.name
            );
            assert_eq!(c.activations.is_some(), o.activations.is_some(), "{label}");
            if let (Some(ca), Some(oa)) = (&c.activations, &o.activations) {
                let e = max_rel(ca, &oa.clone().into_dyn());
                assert!(
                    e < tol,
                    "{label} {dtype:?} site {}: activations differ by {e:e}",
                    c.spec.name
                );
            }
            assert_eq!(c.ids.is_some(), o.ids.is_some(), "{label}");
            if let (Some(ci), Some(oi)) = (&c.ids, &o.ids) {
                let ci: Vec<i64> = ci
                    .to_dtype(DType::I64)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                assert_eq!(
                    ci,
                    oi.iter().copied().collect::<Vec<i64>>(),
                    "{label} site {}: ids",
                    c.spec.name
                );
            }
        }
        // Σ_i g_i of every parameter, from the reference's materialized per-example gradients.
        let grads = r.gradients.as_ref().unwrap();
        assert_eq!(ex.batch_gradient.len(), r.layout.len(), "{label}");
        let mut offset = 0;
        for ((name, shape), (cname, g)) in r.layout.iter().zip(&ex.batch_gradient) {
            assert_eq!(name, cname, "{label}");
            let n: usize = shape.iter().product();
            let sum: Vec<f64> = (0..n)
                .map(|k| grads.iter().map(|gi| gi[offset + k]).sum())
                .collect();
            let want = ndarray::ArrayD::from_shape_vec(shape.clone(), sum).unwrap();
            let e = max_rel(g, &want);
            assert!(
                e < tol,
                "{label} {dtype:?} {name}: batch gradient differs by {e:e}"
            );
            offset += n;
        }
        assert_eq!(ex.losses.len(), r.examples.len(), "{label}");
        for (i, e) in r.examples.iter().enumerate() {
            assert!(
                (ex.losses[i] - e.loss).abs() < tol * e.loss.abs(),
                "{label} {dtype:?}: loss {i} is {} but the reference's is {}",
                ex.losses[i],
                e.loss
            );
        }
    }
    r
}

/// A tied Llama with grouped-query attention: 4 query heads share 2 key/value heads.
fn tiny_llama_gqa() -> Llama {
    let cfg = LlamaConfig::tiny(LlamaFlavor::Llama, 19, 16, 2, 4, 2);
    Llama::random(cfg, 31, 0.5)
}

/// A tied Qwen2 (q/k/v biases) with one key/value head for 4 query heads.
fn tiny_qwen2() -> Llama {
    let mut cfg = LlamaConfig::tiny(LlamaFlavor::Qwen2, 21, 16, 2, 4, 1);
    cfg.rope_theta = 1e6;
    Llama::random(cfg, 32, 0.5)
}

/// An untied Llama with llama3 rope scaling, every bias (`attention_bias`, `mlp_bias`) and a
/// head_dim that is not hidden / heads.
fn tiny_llama3_rope() -> Llama {
    let mut cfg = LlamaConfig::tiny(LlamaFlavor::Llama, 17, 16, 1, 2, 2).untied();
    cfg.head_dim = 12;
    cfg.attention_bias = true;
    cfg.mlp_bias = true;
    // head_dim 12: wavelengths 2π, 29, 135, 623, 2.9e3, 1.3e4 against 64/4 and 64/1: kept,
    // interpolated and divided by the factor.
    cfg.rope_scaling = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 64,
    };
    Llama::random(cfg, 33, 0.5)
}

/// A batch with an ignored label in the second example.
fn llama_batch(vocab: usize, seed: u64) -> Batch {
    let (ids, mut labels) = batch(3, 9, vocab, seed).into_parts();
    labels[(1, 4)] = ghost_oracle_reference::IGNORE;
    Batch::new(ids, Some(labels)).unwrap()
}

fn count_kind(t: &ghost_oracle_reference::Trace, kind: SiteKind) -> usize {
    t.sites.iter().filter(|s| s.spec.kind == kind).count()
}

crate::device_test!(
    candle_llama_gqa_trace_and_batch_gradient_match_the_reference,
    |device| {
        let m = tiny_llama_gqa();
        assert_eq!(m.config.group_size(), 2);
        for reduction in [Reduction::Mean, Reduction::Sum] {
            let r = assert_matches_reference(
                "llama gqa",
                &m.clone().into(),
                &llama_batch(19, 41),
                reduction,
                device,
            );
            let rt = r.trace.as_ref().unwrap();
            // Per layer: 2 RMSNorms and 7 projections, no biases; the final norm, the embedding
            // and the head (writing the embedding).
            assert_eq!(count_kind(rt, SiteKind::Bias), 0);
            assert_eq!(count_kind(rt, SiteKind::LayerNorm), 2 * 2 + 1);
            assert_eq!(count_kind(rt, SiteKind::Linear), 2 * 7 + 1);
            assert_eq!(rt.sites.last().unwrap().spec.param, EMBED_TOKENS);
        }
    }
);

crate::device_test!(candle_qwen2_with_biases_matches_the_reference, |device| {
    let m = tiny_qwen2();
    let r = assert_matches_reference(
        "qwen2",
        &m.clone().into(),
        &llama_batch(21, 42),
        Reduction::Mean,
        device,
    );
    // q, k and v carry biases; o_proj and the MLP do not.
    let rt = r.trace.as_ref().unwrap();
    assert_eq!(count_kind(rt, SiteKind::Bias), 2 * 3);
    assert!(rt
        .sites
        .iter()
        .any(|s| s.spec.name == "model.layers.1.self_attn.k_proj.bias"));
});

crate::device_test!(
    candle_llama3_rope_scaled_untied_with_biases_matches_the_reference,
    |device| {
        let m = tiny_llama3_rope();
        // The scaling moves some frequencies and keeps others: the test would not notice a
        // candle model that ignored it otherwise.
        let mut plain = m.config.clone();
        plain.rope_scaling = RopeScaling::None;
        let (scaled, base) = (m.config.inverse_frequencies(), plain.inverse_frequencies());
        assert_eq!(scaled[0], base[0]);
        assert!(scaled.iter().zip(&base).filter(|(a, b)| a != b).count() >= 2);
        let r = assert_matches_reference(
            "llama3 rope",
            &m.clone().into(),
            &llama_batch(17, 43),
            Reduction::Sum,
            device,
        );
        let rt = r.trace.as_ref().unwrap();
        assert_eq!(count_kind(rt, SiteKind::Bias), 7);
        assert_eq!(
            rt.sites.last().unwrap().spec.param,
            ghost_oracle_reference::LM_HEAD
        );
    }
);

crate::device_test!(
    exact_tied_clippers_on_the_candle_llama_trace_give_the_reference_norms,
    |device| {
        for (label, m, vocab) in [
            ("llama gqa", tiny_llama_gqa(), 19),
            ("qwen2", tiny_qwen2(), 21),
        ] {
            assert!(m.config.tie_word_embeddings);
            let model: Model = m.into();
            let b = llama_batch(vocab, 44);
            let r = ghost_oracle_reference::compute(
                &model,
                &b,
                &ghost_oracle_reference::Options::default(),
                &mut |_| {},
            )
            .unwrap();
            let trace = CandleModel::from_reference(&model, DType::F64, device)
                .unwrap()
                .extract(&b, Reduction::Mean)
                .unwrap()
                .trace;
            let truth: Vec<f64> = r.examples.iter().map(|e| e.norm).collect();
            let rel = |n: &[f64]| -> f64 {
                n.iter()
                    .zip(&truth)
                    .map(|(a, t)| (a - t).abs() / t)
                    .fold(0.0, f64::max)
            };
            for clipper in [
                Box::new(TiedGhostClipper) as Box<dyn Clipper>,
                Box::new(MaterializeClipper),
            ] {
                let e = rel(&clipper.norms(&trace).unwrap().norms);
                assert!(e < 1e-10, "{label} {}: norms off by {e:e}", clipper.name());
            }
            // Standard ghost clipping drops the embedding/head cross term: off far beyond f64
            // rounding on a tied model.
            let e = rel(&GhostClipper.norms(&trace).unwrap().norms);
            assert!(e > 1e-6, "{label} ghost: norms off by only {e:e}");
        }
    }
);

crate::device_test!(
    half_precision_candle_llama_stays_close_to_the_reference,
    |device| {
        let model: Model = tiny_llama_gqa().into();
        let b = llama_batch(19, 45);
        let r = ghost_oracle_reference::compute(
            &model,
            &b,
            &ghost_oracle_reference::Options::default(),
            &mut |_| {},
        )
        .unwrap();
        for (dtype, tol) in [(DType::BF16, 5e-2), (DType::F16, 1e-2)] {
            let ex = CandleModel::from_reference(&model, dtype, device)
                .unwrap()
                .extract(&b, Reduction::Mean)
                .unwrap();
            assert_eq!(ex.trace.dtype(), dtype);
            ex.trace.validate().unwrap();
            for (i, e) in r.examples.iter().enumerate() {
                let rel = (ex.losses[i] - e.loss).abs() / e.loss;
                assert!(rel < tol, "{dtype:?} loss {i} off by {rel:e}");
            }
            let norms = TiedGhostClipper.norms(&ex.trace).unwrap().norms;
            for (n, e) in norms.iter().zip(&r.examples) {
                let rel = (n - e.norm).abs() / e.norm;
                assert!(rel < 2.0 * tol, "{dtype:?} norm off by {rel:e}");
            }
        }
    }
);

#[test]
fn a_batch_that_does_not_fit_the_llama_is_an_error_not_a_panic() {
    let model: Model = tiny_llama_gqa().into();
    let m = CandleModel::from_reference(&model, DType::F32, &Device::Cpu).unwrap();
    let (mut ids, labels) = llama_batch(19, 46).into_parts();
    ids[(2, 1)] = 19;
    let b = Batch::new(ids, Some(labels)).unwrap();
    let err = m.extract(&b, Reduction::Mean).err().unwrap().to_string();
    assert!(err.contains("input_ids[2][1] = 19"), "{err}");
    let long = batch(1, 65, 19, 47);
    let err = m.extract(&long, Reduction::Mean).err().unwrap().to_string();
    assert!(err.contains("max_position_embeddings"), "{err}");
}

/// One tiny model of each newer family, with every feature it has switched on: Qwen3's per-head
/// norms and biases; Gemma's √d, (1 + w) norms, GeGLU and padding row; Gemma 2's windows (3 < T)
/// and both soft-caps, untied; Gemma 3's per-head norms, second rope and final cap; VaultGemma's
/// two norms.
fn newer_families() -> Vec<(&'static str, Llama)> {
    let mut qwen3 = LlamaConfig::tiny(LlamaFlavor::Qwen3, 19, 12, 2, 4, 2);
    qwen3.head_dim = 8;
    qwen3.attention_bias = true;
    let mut gemma = LlamaConfig::tiny(LlamaFlavor::Gemma, 19, 12, 1, 2, 1);
    gemma.pad_token_id = Some(0);
    let mut gemma2 = LlamaConfig::tiny(LlamaFlavor::Gemma2, 19, 12, 2, 2, 1).untied();
    gemma2.sliding_window = Some(3);
    gemma2.attn_logit_softcapping = Some(1.5);
    gemma2.final_logit_softcapping = Some(2.0);
    let mut gemma3 = LlamaConfig::tiny(LlamaFlavor::Gemma3Text, 19, 12, 3, 4, 2);
    gemma3.head_dim = 4;
    gemma3.sliding_window = Some(2);
    gemma3.layer_types = vec![LayerType::Sliding, LayerType::Full, LayerType::Sliding];
    gemma3.local_rope_theta = Some(10.0);
    gemma3.final_logit_softcapping = Some(3.0);
    let mut vault = LlamaConfig::tiny(LlamaFlavor::VaultGemma, 19, 12, 2, 2, 2);
    vault.sliding_window = Some(4);
    vault.attn_logit_softcapping = Some(2.0);
    vec![
        ("qwen3", Llama::random(qwen3, 51, 0.5)),
        ("gemma", Llama::random(gemma, 52, 0.5)),
        ("gemma2", Llama::random(gemma2, 53, 0.5)),
        ("gemma3", Llama::random(gemma3, 54, 0.5)),
        ("vaultgemma", Llama::random(vault, 55, 0.5)),
    ]
}

crate::device_test!(
    candle_qwen3_and_gemma_families_match_the_reference,
    |device| {
        for (label, m) in newer_families() {
            // Token 0 (Gemma's padding row) is an input of every example.
            let (mut ids, labels) = llama_batch(19, 46).into_parts();
            ids.column_mut(2).fill(0);
            let b = Batch::new(ids, Some(labels)).unwrap();
            let heads = (m.config.num_attention_heads, m.config.num_key_value_heads);
            // A per-head norm divides each 8-wide head by its own rms: where a head's
            // projection is small, f32 rounding grows by the same factor. f64 still agrees to
            // 1e-12.
            let f32_tol = if m.config.flavor.head_norms() {
                3e-5
            } else {
                1e-5
            };
            let r =
                assert_matches_reference_at(label, &m.into(), &b, Reduction::Mean, device, f32_tol);
            let rt = r.trace.as_ref().unwrap();
            for site in &rt.sites {
                let rows = site.backprops.dim().1;
                let t = b.seq_len();
                if site.spec.name.ends_with("q_norm.weight") {
                    assert_eq!(rows, t * heads.0, "{label}");
                } else if site.spec.name.ends_with("k_norm.weight") {
                    assert_eq!(rows, t * heads.1, "{label}");
                } else {
                    assert_eq!(rows, t, "{label} {}", site.spec.name);
                }
            }
        }
    }
);

crate::device_test!(
    exact_tied_clippers_on_candle_qwen3_and_gemma3_traces_give_the_reference_norms,
    |device| {
        for (label, m) in newer_families() {
            if !m.config.tie_word_embeddings {
                continue;
            }
            let model: Model = m.into();
            let b = llama_batch(19, 47);
            let r = ghost_oracle_reference::compute(
                &model,
                &b,
                &ghost_oracle_reference::Options::default(),
                &mut |_| {},
            )
            .unwrap();
            let trace = CandleModel::from_reference(&model, DType::F64, device)
                .unwrap()
                .extract(&b, Reduction::Mean)
                .unwrap()
                .trace;
            let truth: Vec<f64> = r.examples.iter().map(|e| e.norm).collect();
            let rel = |n: &[f64]| -> f64 {
                n.iter()
                    .zip(&truth)
                    .map(|(a, t)| (a - t).abs() / t)
                    .fold(0.0, f64::max)
            };
            for clipper in [
                Box::new(TiedGhostClipper) as Box<dyn Clipper>,
                Box::new(MaterializeClipper),
            ] {
                let e = rel(&clipper.norms(&trace).unwrap().norms);
                assert!(e < 1e-10, "{label} {}: norms off by {e:e}", clipper.name());
            }
            let e = rel(&GhostClipper.norms(&trace).unwrap().norms);
            assert!(e > 1e-6, "{label} ghost: norms off by only {e:e}");
        }
    }
);

/// `audit --model` on checkpoints saved by transformers (the golden cases): the exact clippers
/// pass, and standard ghost clipping, which drops the tied cross term, is flagged.
#[test]
fn audit_model_on_hf_checkpoints_of_the_newer_families() {
    use crate::cli::gate_on_golden;
    for case in [
        "qwen3_tied_gqa_t2",
        "gemma_tied_pad_t12",
        "gemma2_tied_window_softcap_t34",
        "gemma3_tied_window_t40",
        "vaultgemma_tied_window_softcap_t33",
    ] {
        assert_eq!(gate_on_golden(case, "materialize"), Some(0), "{case}");
        assert_eq!(gate_on_golden(case, "ghost-tied"), Some(0), "{case}");
        assert_eq!(gate_on_golden(case, "ghost"), Some(1), "{case}");
    }
    for case in ["qwen3_untied_bias_ignored_t33", "gemma3_untied_bf16_t8"] {
        assert_eq!(gate_on_golden(case, "ghost"), Some(0), "{case}");
    }
}
