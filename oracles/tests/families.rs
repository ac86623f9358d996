//! Qwen3 and the Gemma family (Gemma, Gemma 2, Gemma 3, VaultGemma) in the reference: their
//! gradients against central finite differences of their own loss on every parameter tensor,
//! with sliding windows shorter than the sequence and soft-capping on; their traces (per-head
//! q/k norms included) against their materialized gradients; the padding row; their
//! checkpoints and config errors. The PyTorch golden files (`reference.rs`) pin them to HF.

mod common;

use common::{
    assert_trace_gives_the_reported_norms, check_finite_differences, close, config_error,
};
use ghost_oracle_reference::*;
use ndarray::array;
use std::path::PathBuf;

fn fd_batch() -> Batch {
    // Repeated tokens (3 and 5) and a target (5) that is also an input; T = 8 is longer than
    // every window below.
    Batch::new(array![[3_i64, 5, 7, 3, 5, 1, 9, 2]], None).unwrap()
}

/// Qwen3, tied, 4 query heads over 2 key/value heads, head_dim 8 ≠ hidden / heads, with
/// `attention_bias` on.
fn qwen3() -> Llama {
    let mut cfg = LlamaConfig::tiny(LlamaFlavor::Qwen3, 11, 12, 2, 4, 2);
    cfg.head_dim = 8;
    cfg.attention_bias = true;
    cfg.rope_theta = 1000.0;
    Llama::random(cfg, 11, 0.4)
}

/// The Gemma settings of a tiny config: √d embedding, (1 + w) norms, GeGLU come with the flavor.
fn gemma_cfg(flavor: LlamaFlavor, layers: usize) -> LlamaConfig {
    let mut cfg = LlamaConfig::tiny(flavor, 13, 12, layers, 2, 1);
    cfg.head_dim = 8;
    cfg
}

fn gemma() -> Llama {
    Llama::random(gemma_cfg(LlamaFlavor::Gemma, 2), 12, 0.4)
}

/// Gemma 2, untied: a window of 3 on layer 0, full attention on layer 1, both soft-caps small
/// enough to bend the scores and logits.
fn gemma2() -> Llama {
    let mut cfg = gemma_cfg(LlamaFlavor::Gemma2, 2).untied();
    cfg.query_pre_attn_scalar = Some(6.0);
    cfg.attn_logit_softcapping = Some(1.5);
    cfg.final_logit_softcapping = Some(2.0);
    cfg.sliding_window = Some(3);
    cfg.layer_types = vec![LayerType::Sliding, LayerType::Full];
    Llama::random(cfg, 13, 0.5)
}

/// Gemma 3, tied: per-head q/k norms, a window of 2 and a rope base of its own on layers 0 and
/// 2, final-logit soft-capping.
fn gemma3() -> Llama {
    let mut cfg = gemma_cfg(LlamaFlavor::Gemma3Text, 3);
    cfg.num_attention_heads = 4;
    cfg.num_key_value_heads = 2;
    cfg.query_pre_attn_scalar = Some(8.0);
    cfg.final_logit_softcapping = Some(3.0);
    cfg.sliding_window = Some(2);
    cfg.layer_types = vec![LayerType::Sliding, LayerType::Full, LayerType::Sliding];
    cfg.rope_theta = 1e6;
    cfg.local_rope_theta = Some(10.0);
    Llama::random(cfg, 14, 0.3)
}

/// VaultGemma, tied: its two pre-norms only, soft-capping and a window of 4.
fn vaultgemma() -> Llama {
    let mut cfg = gemma_cfg(LlamaFlavor::VaultGemma, 2);
    cfg.query_pre_attn_scalar = Some(8.0);
    cfg.attn_logit_softcapping = Some(2.0);
    cfg.final_logit_softcapping = Some(2.5);
    cfg.sliding_window = Some(4);
    cfg.layer_types = vec![LayerType::Sliding, LayerType::Full];
    Llama::random(cfg, 15, 0.5)
}

fn all() -> [Llama; 5] {
    [qwen3(), gemma(), gemma2(), gemma3(), vaultgemma()]
}

#[test]
fn finite_differences_qwen3() {
    // embedding + 2 × (2 norms + 7 projections + 4 biases + q/k norms) + final norm.
    assert_eq!(check_finite_differences(&qwen3(), &fd_batch()), 32);
}

#[test]
fn finite_differences_gemma() {
    // embedding + 2 × (2 norms + 7 projections) + final norm.
    assert_eq!(check_finite_differences(&gemma(), &fd_batch()), 20);
}

#[test]
fn finite_differences_gemma2_window_and_soft_capping() {
    // embedding + 2 × (4 norms + 7 projections) + final norm + lm_head.
    assert_eq!(check_finite_differences(&gemma2(), &fd_batch()), 25);
}

#[test]
fn finite_differences_gemma3_head_norms_and_local_rope() {
    // embedding + 3 × (4 norms + 7 projections + q/k norms) + final norm.
    assert_eq!(check_finite_differences(&gemma3(), &fd_batch()), 41);
}

#[test]
fn finite_differences_vaultgemma() {
    // embedding + 2 × (2 norms + 7 projections) + final norm.
    assert_eq!(check_finite_differences(&vaultgemma(), &fd_batch()), 20);
}

#[test]
fn finite_differences_with_ignored_labels() {
    let ids = array![[3_i64, 5, 7, 3, 5, 1, 9]];
    let labels = array![[3_i64, -100, 7, -100, 5, 1, -100]];
    let batch = Batch::new(ids, Some(labels)).unwrap();
    for model in [gemma2(), gemma3()] {
        check_finite_differences(&model, &batch);
    }
}

fn norms(model: &Llama, batch: &Batch) -> Vec<f64> {
    let r = compute(model, batch, &Options::default(), &mut |_| {}).unwrap();
    r.examples.iter().map(|e| e.norm).collect()
}

/// The features are really on: a window at least T long, caps far above every score and a local
/// rope base equal to the global one are exactly the model without them, and each one, set
/// tight, moves the norms.
#[test]
fn windows_caps_and_local_rope_change_the_model_only_when_active() {
    let batch = fd_batch();
    let t = 8;
    let base = gemma3();
    let mut plain = base.clone();
    plain.config.sliding_window = Some(t);
    plain.config.final_logit_softcapping = None;
    plain.config.local_rope_theta = Some(plain.config.rope_theta);
    let mut wide = plain.clone();
    wide.config.sliding_window = Some(10 * t);
    wide.config.final_logit_softcapping = Some(1e9);
    let (a, b) = (norms(&plain, &batch), norms(&wide, &batch));
    assert!(close(a[0], b[0], 1e-12), "{a:?} vs {b:?}");
    let mut full = plain.clone();
    full.config.layer_types = vec![LayerType::Full; 3];
    assert!(close(norms(&full, &batch)[0], a[0], 1e-12));
    for (what, m) in [
        ("window", {
            let mut m = plain.clone();
            m.config.sliding_window = Some(2);
            m
        }),
        ("final cap", {
            let mut m = plain.clone();
            m.config.final_logit_softcapping = Some(3.0);
            m
        }),
        ("local rope", {
            let mut m = plain.clone();
            m.config.local_rope_theta = Some(10.0);
            m
        }),
    ] {
        let n = norms(&m, &batch)[0];
        assert!(!close(n, a[0], 1e-6), "{what}: {n} vs {}", a[0]);
    }
    let mut capped = gemma2();
    capped.config.attn_logit_softcapping = None;
    assert!(!close(
        norms(&capped, &batch)[0],
        norms(&gemma2(), &batch)[0],
        1e-6
    ));
}

/// HF's `nn.Embedding(padding_idx = pad_token_id)`: the padding row gets no gradient from the
/// input path, every other gradient is untouched.
#[test]
fn the_padding_row_has_no_input_path_gradient() {
    let batch = Batch::new(array![[3_i64, 5, 7, 3, 7, 1]], None).unwrap();
    let model = gemma();
    let mut padded = model.clone();
    padded.config.pad_token_id = Some(7);
    let a = example_gradient(&model, &batch, 0, Reduction::Mean, false).unwrap();
    let b = example_gradient(&padded, &batch, 0, Reduction::Mean, false).unwrap();
    assert_eq!(a.loss, b.loss);
    let (ea, eb) = (&a.grad.embed_tokens, &b.grad.embed_tokens);
    for row in 0..ea.nrows() {
        if row == 7 {
            assert!(ea.row(row).iter().any(|v| *v != 0.0));
            assert!(eb.row(row).iter().all(|v| *v == 0.0));
        } else {
            assert_eq!(ea.row(row), eb.row(row));
        }
    }
    assert_eq!(a.grad.lm_head, b.grad.lm_head);
    assert_eq!(a.grad.layers, b.grad.layers);
}

#[test]
fn trace_rebuilds_the_materialized_gradients() {
    let batch = Batch::new(array![[1_i64, 2, 1, 3, 2, 1], [4, 4, 4, 0, 10, 9]], None).unwrap();
    for model in all() {
        let flavor = model.config.flavor;
        let opts = Options {
            record_trace: true,
            ..Options::default()
        };
        let r = compute(&model, &batch, &opts, &mut |_| {}).unwrap();
        let trace = r.trace.as_ref().unwrap();
        trace.validate().unwrap();
        let params: Vec<String> = trace.params().into_iter().map(|(p, _)| p).collect();
        let layout: Vec<String> = r.layout.iter().map(|(n, _)| n.clone()).collect();
        assert_eq!(params, layout, "{flavor:?}");
        assert_eq!(
            LlamaParams::layout(&model.config, !model.config.tie_word_embeddings),
            Model::from(model.clone()).layout(),
            "{flavor:?}"
        );
        for site in &trace.sites {
            let rows = site.backprops.dim().1;
            // A per-head norm has a row per (position, head) pair, every other site one per
            // position.
            let want = if site.spec.name.ends_with("q_norm.weight") {
                6 * model.config.num_attention_heads
            } else if site.spec.name.ends_with("k_norm.weight") {
                6 * model.config.num_key_value_heads
            } else {
                6
            };
            assert_eq!(rows, want, "{flavor:?} {}", site.spec.name);
        }
        assert_trace_gives_the_reported_norms(&r, &format!("{flavor:?}"));
        let n: usize = r
            .layout
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum();
        assert_eq!(n, model.config.parameter_count(), "{flavor:?}");
    }
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("go-ref-families-{tag}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    dir
}

#[test]
fn checkpoint_round_trip_and_model_dispatch() {
    for model in all() {
        let tag = model.config.flavor.model_type();
        let dir = temp_dir(tag);
        model.save(&dir, false).unwrap();
        assert_eq!(load_resident::<Llama>(&dir).unwrap(), model, "{tag}");
        let any = load::<Model>(&dir).unwrap();
        assert_eq!(any.model_type(), tag);
        std::fs::remove_dir_all(&dir).ok();
    }
}

#[test]
fn unsupported_config_values_are_errors_naming_the_key() {
    let base = r#""vocab_size": 16, "hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4"#;
    let cases: [(&str, &str); 12] = [
        (
            r#""model_type": "gemma2", "hidden_activation": "silu""#,
            "hidden_activation",
        ),
        (
            r#""model_type": "gemma", "hidden_act": "relu""#,
            "hidden_act",
        ),
        (
            r#""model_type": "qwen3", "hidden_act": "gelu""#,
            "hidden_act",
        ),
        (
            r#""model_type": "gemma3_text", "use_bidirectional_attention": true"#,
            "use_bidirectional_attention",
        ),
        (
            r#""model_type": "gemma2", "layer_types": ["sliding_attention"]"#,
            "layer_types",
        ),
        (
            r#""model_type": "gemma2", "layer_types": ["full_attention", "chunked_attention"]"#,
            "layer_types[1]",
        ),
        (
            r#""model_type": "vaultgemma", "sliding_window": null"#,
            "sliding_window",
        ),
        (
            r#""model_type": "gemma2", "attn_logit_softcapping": -1.0"#,
            "attn_logit_softcapping",
        ),
        (
            r#""model_type": "gemma3_text", "rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 8.0}, "sliding_attention": {"rope_type": "default"}}"#,
            "rope_parameters.full_attention",
        ),
        (
            r#""model_type": "gemma3_text", "rope_parameters": {"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8}}"#,
            "sliding_attention",
        ),
        (
            r#""model_type": "qwen3", "use_sliding_window": true, "sliding_window": 4, "max_window_layers": 0"#,
            "use_sliding_window",
        ),
        (
            r#""model_type": "gemma", "pad_token_id": 16"#,
            "pad_token_id",
        ),
    ];
    for (extra, key) in cases {
        let json = format!("{{{base}, {extra}}}");
        let msg = config_error(&json);
        assert!(
            msg.contains(key),
            "{extra}: message {msg:?} does not name {key}"
        );
    }
    let cfg = |extra: &str| match ModelConfig::from_json_str(&format!("{{{base}, {extra}}}")) {
        Ok(ModelConfig::Llama(c)) => c,
        other => panic!("{extra}: {other:?}"),
    };
    // HF's defaults: Gemma 2 alternates sliding and full layers with a 4096 window and caps of
    // 50 and 30; Gemma 3 makes every sixth layer full, reads `rope_local_base_freq`, and its
    // attention ignores `attn_logit_softcapping`, as Gemma3Attention does.
    let g2 = cfg(r#""model_type": "gemma2""#);
    assert_eq!(g2.layer_types, vec![LayerType::Sliding, LayerType::Full]);
    assert_eq!(g2.sliding_window, Some(4096));
    assert_eq!(
        (g2.attn_logit_softcapping, g2.final_logit_softcapping),
        (Some(50.0), Some(30.0))
    );
    assert_eq!(g2.pad_token_id, Some(0));
    assert!(g2.tie_word_embeddings);
    let g2_off = cfg(
        r#""model_type": "gemma2", "attn_logit_softcapping": null, "final_logit_softcapping": null"#,
    );
    assert_eq!(
        (
            g2_off.attn_logit_softcapping,
            g2_off.final_logit_softcapping
        ),
        (None, None)
    );
    let g3 = cfg(
        r#""model_type": "gemma3_text", "num_hidden_layers": 7, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": null, "attn_logit_softcapping": 50.0, "sliding_window": 512"#,
    );
    let full: Vec<usize> = (0..7)
        .filter(|&i| g3.layer_types[i] == LayerType::Full)
        .collect();
    assert_eq!(full, vec![5]);
    assert_eq!((g3.rope_theta, g3.local_rope_theta), (1e6, Some(1e4)));
    assert_eq!(g3.attn_logit_softcapping, None);
    assert_eq!(g3.final_logit_softcapping, None);
    assert_eq!(g3.attention_scale(), 1.0 / 16.0);
    // A config without head_dim takes the class's default (Qwen3 128, Gemma 256), not
    // hidden / heads, as HF's config classes do.
    let q3 = cfg(r#""model_type": "qwen3""#).head_dim;
    let no_head_dim = r#"{"model_type": "qwen3", "vocab_size": 16, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 32, "intermediate_size": 12}"#;
    match ModelConfig::from_json_str(no_head_dim).unwrap() {
        ModelConfig::Llama(c) => assert_eq!((q3, c.head_dim, c.num_key_value_heads), (4, 128, 32)),
        // (Qwen3Config's default for num_key_value_heads is 32, too.)
        ModelConfig::Gpt2(_) => panic!("qwen3 parsed as GPT-2"),
    }
}
