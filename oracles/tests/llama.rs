//! The Llama family (Llama, Qwen2) in the reference: its gradients against central finite
//! differences of its own loss on every parameter tensor, its grouped-query attention against
//! the equivalent multi-head model, its llama3 rope frequencies against Hugging Face's, its
//! trace against its materialized gradients, and its config and checkpoint errors.

mod common;

use common::{check_finite_differences, close, config_error};
use ghost_oracle_reference::*;
use ndarray::{array, s, Array2};
use std::path::PathBuf;

fn fd_batch() -> Batch {
    // Repeated tokens (3 and 5) and a target (5) that is also an input.
    Batch::new(array![[3_i64, 5, 7, 3, 5, 1, 9, 2]], None).unwrap()
}

/// Tied, grouped-query (4 query heads sharing 2 key/value heads), two layers, no biases.
fn tied_gqa() -> Llama {
    Llama::random(
        LlamaConfig::tiny(LlamaFlavor::Llama, 11, 16, 2, 4, 2),
        1,
        0.4,
    )
}

/// Qwen2, tied, with its q/k/v biases; 4 query heads over 1 key/value head.
fn qwen2_biases() -> Llama {
    let mut cfg = LlamaConfig::tiny(LlamaFlavor::Qwen2, 11, 16, 2, 4, 1);
    cfg.rope_theta = 1e6;
    Llama::random(cfg, 2, 0.4)
}

/// llama3 rope scaling with all three frequency bands in use, an explicit head_dim (8) that is
/// not hidden/heads, untied head, and Llama's optional biases on.
fn llama3_scaled() -> Llama {
    let mut cfg = LlamaConfig::tiny(LlamaFlavor::Llama, 13, 12, 2, 2, 1).untied();
    cfg.head_dim = 8;
    cfg.rope_scaling = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 64,
    };
    cfg.attention_bias = true;
    cfg.mlp_bias = true;
    Llama::random(cfg, 3, 0.4)
}

#[test]
fn finite_differences_tied_grouped_query_llama() {
    let model = tied_gqa();
    assert!(model.config.group_size() == 2 && model.config.tie_word_embeddings);
    // embedding + 2 × (2 norms + 7 projections) + final norm.
    assert_eq!(check_finite_differences(&model, &fd_batch()), 20);
}

#[test]
fn finite_differences_qwen2_with_biases() {
    let model = qwen2_biases();
    // embedding + 2 × (2 norms + 7 projections + q/k/v biases) + final norm.
    assert_eq!(check_finite_differences(&model, &fd_batch()), 26);
    let names: Vec<String> = model.params.tensors().into_iter().map(|(n, _)| n).collect();
    assert!(names.contains(&"model.layers.1.self_attn.k_proj.bias".to_string()));
    assert!(!names
        .iter()
        .any(|n| n.contains("o_proj.bias") || n.contains("mlp") && n.ends_with("bias")));
}

#[test]
fn finite_differences_llama3_rope_scaling() {
    let model = llama3_scaled();
    // embedding + 2 × (2 norms + 7 projections + 7 biases) + final norm + lm_head.
    assert_eq!(check_finite_differences(&model, &fd_batch()), 35);
}

#[test]
fn finite_differences_with_ignored_labels_and_sum_reduction() {
    let model = tied_gqa();
    let ids = array![[3_i64, 5, 7, 3, 5, 1, 9]];
    let labels = array![[3_i64, -100, 7, -100, 5, 1, -100]];
    let batch = Batch::new(ids, Some(labels)).unwrap();
    check_finite_differences(&model, &batch);
    // Sum reduction is the mean times the number of kept targets (here 3).
    let mean = example_gradient(&model, &batch, 0, Reduction::Mean, false).unwrap();
    let sum = example_gradient(&model, &batch, 0, Reduction::Sum, false).unwrap();
    assert!(close(sum.loss, 3.0 * mean.loss, 1e-13));
    let (a, b) = (
        &mean.grad.layers[1].down_proj.weight,
        &sum.grad.layers[1].down_proj.weight,
    );
    assert!((b - &(a * 3.0)).iter().all(|v| v.abs() < 1e-12));
}

/// Hugging Face's `_compute_llama3_parameters` (transformers 5.24, float32) for two configs:
/// (theta, head_dim, factor, low, high, original) → inverse frequencies.
#[test]
fn llama3_inverse_frequencies_match_hugging_face() {
    let cases: [(f64, usize, f64, usize, &[f64]); 2] = [
        (
            10000.0,
            8,
            8.0,
            64,
            &[
                1.0,
                0.013042256236076355,
                0.0012499999720603228,
                0.0001250000059371814,
            ],
        ),
        (
            500000.0,
            16,
            32.0,
            8192,
            &[
                1.0,
                0.193922758102417,
                0.03760603070259094,
                0.00729266507551074,
                0.000429556705057621,
                8.570255886297673e-06,
                1.6619674170215148e-06,
                3.2229328894572973e-07,
            ],
        ),
    ];
    for (theta, head_dim, factor, original, want) in cases {
        let mut cfg = LlamaConfig::tiny(LlamaFlavor::Llama, 8, head_dim, 1, 1, 1);
        cfg.rope_theta = theta;
        cfg.rope_scaling = RopeScaling::Llama3 {
            factor,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: original,
        };
        let got = cfg.inverse_frequencies();
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            // HF evaluates in float32.
            assert!(close(*g, *w, 2e-6), "theta {theta}: {g} vs {w}");
        }
    }
}

/// A grouped-query model is the multi-head model whose key/value heads are copied to every
/// query head of their group (HF's `repeat_kv`): same loss, and the grouped k/v gradient is the
/// sum of the copies' gradients.
#[test]
fn grouped_query_attention_is_repeated_key_value_heads() {
    let gqa = tied_gqa();
    let cfg = &gqa.config;
    let (hd, group) = (cfg.head_dim, cfg.group_size());
    let mut mha_cfg = cfg.clone();
    mha_cfg.num_key_value_heads = cfg.num_attention_heads;
    let mut mha = Llama::random(mha_cfg, 0, 0.0);
    mha.params = {
        let mut p = gqa.params.clone();
        for layer in p.layers.iter_mut() {
            for proj in [&mut layer.k_proj, &mut layer.v_proj] {
                let src = proj.weight.clone();
                let mut w = Array2::zeros((cfg.num_attention_heads * hd, cfg.hidden_size));
                for h in 0..cfg.num_attention_heads {
                    let kv = h / group;
                    w.slice_mut(s![h * hd..(h + 1) * hd, ..])
                        .assign(&src.slice(s![kv * hd..(kv + 1) * hd, ..]));
                }
                proj.weight = w;
            }
        }
        p
    };
    let batch = fd_batch();
    let a = example_gradient(&gqa, &batch, 0, Reduction::Mean, false).unwrap();
    let b = example_gradient(&mha, &batch, 0, Reduction::Mean, false).unwrap();
    assert!(close(a.loss, b.loss, 1e-13), "{} vs {}", a.loss, b.loss);
    for l in 0..cfg.num_hidden_layers {
        for (ga, gb) in [
            (
                &a.grad.layers[l].k_proj.weight,
                &b.grad.layers[l].k_proj.weight,
            ),
            (
                &a.grad.layers[l].v_proj.weight,
                &b.grad.layers[l].v_proj.weight,
            ),
        ] {
            for kv in 0..cfg.num_key_value_heads {
                let mut sum = Array2::<f64>::zeros((hd, cfg.hidden_size));
                for h in kv * group..(kv + 1) * group {
                    sum += &gb.slice(s![h * hd..(h + 1) * hd, ..]);
                }
                let got = ga.slice(s![kv * hd..(kv + 1) * hd, ..]);
                let err = (&got - &sum).iter().fold(0.0_f64, |m, v| m.max(v.abs()));
                assert!(err < 1e-13, "layer {l} kv head {kv}: {err}");
            }
        }
        let (qa, qb) = (
            &a.grad.layers[l].q_proj.weight,
            &b.grad.layers[l].q_proj.weight,
        );
        assert!((qa - qb).iter().all(|v| v.abs() < 1e-13));
    }
}

#[test]
fn trace_rebuilds_the_materialized_gradients() {
    // The recorded factors, materialized site by site and summed per parameter, must give the
    // very norms of the explicit backward pass: a wrong activation or backprop would not.
    for model in [tied_gqa(), qwen2_biases(), llama3_scaled()] {
        let batch = Batch::new(array![[1_i64, 2, 1, 3, 2, 1], [4, 4, 4, 0, 10, 9]], None).unwrap();
        let opts = Options {
            record_trace: true,
            ..Options::default()
        };
        let r = compute(&model, &batch, &opts, &mut |_| {}).unwrap();
        let trace = r.trace.as_ref().unwrap();
        // Every parameter has a site, in the reference's parameter order.
        let params: Vec<String> = trace.params().into_iter().map(|(p, _)| p).collect();
        let layout: Vec<String> = r.layout.iter().map(|(n, _)| n.clone()).collect();
        assert_eq!(params, layout);
        for site in &trace.sites {
            let kind = site.spec.kind;
            let expected = if site.spec.name.ends_with("norm.weight") {
                SiteKind::LayerNorm
            } else if site.spec.name.ends_with(".bias") {
                SiteKind::Bias
            } else if site.spec.name == EMBED_TOKENS {
                SiteKind::Embedding
            } else {
                SiteKind::Linear
            };
            assert_eq!(kind, expected, "{}", site.spec.name);
        }
        let head = trace.sites.last().unwrap();
        assert_eq!(head.spec.name, LM_HEAD);
        let tied = model.config.tie_word_embeddings;
        assert_eq!(head.spec.param, if tied { EMBED_TOKENS } else { LM_HEAD });
        let m = trace.materialized_norms().unwrap();
        for (i, e) in r.examples.iter().enumerate() {
            assert!(close(m[i].total_sq.sqrt(), e.norm, 1e-12), "example {i}");
            for (name, v) in &e.params {
                assert!(close(m[i].per_param_sq[name].sqrt(), *v, 1e-12), "{name}");
            }
            assert_eq!(e.shared.len(), usize::from(tied));
            if let Some((name, s)) = e.shared.first() {
                assert_eq!(name, EMBED_TOKENS);
                let k = &m[i].shared_inner[name];
                assert!(close(k[0][0], s.input_sq, 1e-12) && close(k[1][1], s.output_sq, 1e-12));
                assert!((k[0][1] - s.cross).abs() <= 1e-12 * (s.input_sq + s.output_sq));
                let norm = e.params.iter().find(|(n, _)| n == name).unwrap().1;
                let identity = s.input_sq + s.output_sq + 2.0 * s.cross;
                assert!((norm * norm - identity).abs() <= 1e-13 * identity);
            }
        }
    }
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("go-ref-llama-{tag}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    dir
}

#[test]
fn checkpoint_round_trip_and_model_dispatch() {
    for (tag, model) in [
        ("gqa", tied_gqa()),
        ("qwen", qwen2_biases()),
        ("l3", llama3_scaled()),
    ] {
        let dir = temp_dir(tag);
        model.save(&dir, false).unwrap();
        assert_eq!(load_resident::<Llama>(&dir).unwrap(), model);
        match load_resident::<Model>(&dir).unwrap() {
            Model::Llama(m) => assert_eq!(m, model),
            Model::Gpt2(_) => panic!("{tag}: loaded as GPT-2"),
        }
        model.save(&dir, true).unwrap();
        let back = load::<Llama>(&dir).unwrap();
        let err = (&back.params.embed_tokens - &model.params.embed_tokens)
            .iter()
            .fold(0.0_f64, |a, v| a.max(v.abs()));
        assert!(err > 0.0 && err < 1e-6, "f32 round trip error {err}");
        std::fs::remove_dir_all(&dir).ok();
    }
    let dir = temp_dir("gpt2");
    let gpt2 = Gpt2::random(Gpt2Config::tiny(9, 6, 4, 1, 2), 8, 0.3);
    gpt2.save(&dir, false).unwrap();
    assert_eq!(load::<Model>(&dir).unwrap(), Model::Gpt2(gpt2));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn model_enum_reference_equals_the_family_reference() {
    let model = qwen2_biases();
    let batch = Batch::new(array![[1_i64, 2, 1, 3], [4, 4, 0, 10]], None).unwrap();
    let direct = compute(&model, &batch, &Options::default(), &mut |_| {}).unwrap();
    let any = Model::from(model.clone());
    let via = compute(&any, &batch, &Options::default(), &mut |_| {}).unwrap();
    for (a, b) in direct.examples.iter().zip(&via.examples) {
        assert_eq!(a.norm, b.norm);
        assert_eq!(a.params, b.params);
    }
    assert_eq!(any.layout(), direct.layout);
    assert_eq!(any.parameter_count(), model.config.parameter_count());
    let n: usize = direct
        .layout
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    assert_eq!(n, model.config.parameter_count());
}

#[test]
fn unsupported_config_values_are_errors_naming_the_key() {
    let base = r#""vocab_size": 16, "hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 1, "num_attention_heads": 2"#;
    let cases: [(&str, &str); 14] = [
        (
            r#""model_type": "llama", "hidden_act": "gelu""#,
            "hidden_act",
        ),
        (
            r#""model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}"#,
            "rope_type",
        ),
        (
            r#""model_type": "llama", "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}"#,
            "\"linear\"",
        ),
        (
            r#""model_type": "llama", "rope_scaling": {"type": "dynamic", "factor": 2.0}"#,
            "\"dynamic\"",
        ),
        (
            r#""model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}"#,
            "original_max_position_embeddings",
        ),
        (
            r#""model_type": "llama", "rope_scaling": {"rope_type": "default", "factor": 8.0}"#,
            "`factor`",
        ),
        (
            r#""model_type": "llama", "rope_theta": 10000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}"#,
            "rope_theta",
        ),
        (
            r#""model_type": "llama", "partial_rotary_factor": 0.5"#,
            "partial_rotary_factor",
        ),
        (
            r#""model_type": "llama", "num_key_value_heads": 3"#,
            "num_key_value_heads",
        ),
        (
            r#""model_type": "qwen2", "use_sliding_window": true, "sliding_window": 4, "max_window_layers": 0"#,
            "use_sliding_window",
        ),
        (
            r#""model_type": "qwen2", "layer_types": ["sliding_attention"]"#,
            "layer_types",
        ),
        (r#""model_type": "qwen2", "mlp_bias": true"#, "mlp_bias"),
        (
            r#""model_type": "llama", "rms_norm_eps": -1"#,
            "rms_norm_eps",
        ),
        (r#""model_type": "mistral""#, "model_type"),
    ];
    for (extra, key) in cases {
        let json = format!("{{{base}, {extra}}}");
        let msg = config_error(&json);
        assert!(
            msg.contains(key),
            "{extra}: message {msg:?} does not name {key}"
        );
    }
    // Accepted: the transformers-4 layout of Llama 3.2 and an inactive Qwen2 sliding window.
    let llama32 = format!(
        r#"{{{base}, "model_type": "llama", "rope_theta": 500000.0, "tie_word_embeddings": true, "head_dim": 4,
        "rope_scaling": {{"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3"}}}}"#
    );
    match ModelConfig::from_json_str(&llama32).unwrap() {
        ModelConfig::Llama(c) => {
            assert_eq!(c.rope_theta, 500000.0);
            assert!(matches!(
                c.rope_scaling,
                RopeScaling::Llama3 {
                    original_max_position_embeddings: 8192,
                    ..
                }
            ));
            assert_eq!((c.num_key_value_heads, c.head_dim), (2, 4));
        }
        ModelConfig::Gpt2(_) => panic!("llama config parsed as GPT-2"),
    }
    let qwen = format!(
        r#"{{{base}, "model_type": "qwen2", "use_sliding_window": false, "sliding_window": 32768, "max_window_layers": 0, "rope_scaling": null}}"#
    );
    let c = LlamaConfig::from_json_str(&qwen).unwrap();
    assert!(c.qkv_bias() && !c.o_proj_bias() && !c.mlp_biases() && !c.tie_word_embeddings);
}

/// A change to a checkpoint's (name, tensor) list.
type Edit<'a> = dyn Fn(&mut Vec<(String, ndarray::ArrayD<f64>)>) + 'a;

#[test]
fn checkpoint_errors_name_the_file_and_tensor() {
    let model = qwen2_biases();
    let dir = temp_dir("errors");
    model.save(&dir, false).unwrap();
    let path = dir.join("model.safetensors");
    let label = path.display().to_string();
    let rewrite = |edit: &Edit<'_>| {
        let mut t: Vec<(String, ndarray::ArrayD<f64>)> = model
            .params
            .tensors()
            .into_iter()
            .map(|(n, v)| (n, v.to_owned()))
            .collect();
        edit(&mut t);
        let views: Vec<(String, ndarray::ArrayViewD<f64>)> =
            t.iter().map(|(n, v)| (n.clone(), v.view())).collect();
        write_f64_tensors(&path, &views, false, None).unwrap();
        load::<Model>(&dir)
    };
    let err = |edit: &Edit<'_>| {
        let msg = rewrite(edit).unwrap_err().to_string();
        assert!(msg.contains(&label), "{msg} does not name {label}");
        msg
    };
    let missing = err(&|t| t.retain(|(n, _)| n != "model.layers.1.self_attn.v_proj.bias"));
    assert!(
        missing.contains("`model.layers.1.self_attn.v_proj.bias` is missing"),
        "{missing}"
    );
    let shape = err(&|t| {
        let e = t
            .iter_mut()
            .find(|(n, _)| n == "model.layers.0.mlp.up_proj.weight")
            .unwrap();
        e.1 = ndarray::ArrayD::zeros(vec![3, 3]);
    });
    assert!(
        shape.contains("`model.layers.0.mlp.up_proj.weight` has shape [3, 3]"),
        "{shape}"
    );
    let extra = err(&|t| {
        t.push((
            "model.layers.0.self_attn.o_proj.bias".into(),
            ndarray::ArrayD::zeros(vec![16]),
        ))
    });
    assert!(
        extra.contains("unexpected tensor `model.layers.0.self_attn.o_proj.bias`"),
        "{extra}"
    );
    let head = err(&|t| t.push((LM_HEAD.into(), ndarray::ArrayD::zeros(vec![11, 16]))));
    assert!(
        head.contains("differs from `model.embed_tokens.weight`"),
        "{head}"
    );
    let nan = err(&|t| t[2].1[[0, 0]] = f64::NAN);
    assert!(
        nan.contains("`model.layers.0.self_attn.q_proj.weight` holds a non-finite value"),
        "{nan}"
    );
    // A tied checkpoint may carry an exact copy of the head, and old exports the rotary buffer.
    let ok = rewrite(&|t| {
        t.push((LM_HEAD.into(), model.params.embed_tokens.clone().into_dyn()));
        t.push((
            "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
            ndarray::ArrayD::zeros(vec![2]),
        ));
    });
    ok.unwrap();
    assert_eq!(
        load_resident::<Model>(&dir).unwrap(),
        Model::Llama(model.clone())
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn batch_longer_than_the_context_is_an_error() {
    let model = tied_gqa();
    let ids = Array2::from_shape_fn((1, 65), |(_, t)| (t % 11) as i64);
    let err = compute(
        &model,
        &Batch::new(ids, None).unwrap(),
        &Options::default(),
        &mut |_| {},
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("max_position_embeddings = 64"),
        "{err}"
    );
}
