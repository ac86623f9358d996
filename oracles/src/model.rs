//! GPT-2 parameters in f64, by the names Hugging Face gives them.

use crate::config::Gpt2Config;
use crate::error::{bail, Error, Result};
use crate::rng::SplitMix64;
use crate::tensors;
use ndarray::{Array1, Array2, ArrayViewD, ArrayViewMutD};
use std::path::Path;

#[derive(Clone, Debug, PartialEq)]
pub struct LayerNorm {
    pub weight: Array1<f64>,
    pub bias: Array1<f64>,
}

/// HF `Conv1D`: `y = x W + b` with `W` stored in×out.
#[derive(Clone, Debug, PartialEq)]
pub struct Conv1d {
    pub weight: Array2<f64>,
    pub bias: Array1<f64>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Block {
    pub ln_1: LayerNorm,
    pub c_attn: Conv1d,
    pub attn_proj: Conv1d,
    pub ln_2: LayerNorm,
    pub c_fc: Conv1d,
    pub mlp_proj: Conv1d,
}

/// One value per parameter tensor. The same type holds weights and gradients; in a gradient of a
/// tied model `wte` holds the input-embedding path and `lm_head` the head path, which is how the
/// reference reports the split.
#[derive(Clone, Debug, PartialEq)]
pub struct Params {
    pub wte: Array2<f64>,
    pub wpe: Array2<f64>,
    pub blocks: Vec<Block>,
    pub ln_f: LayerNorm,
    /// V×d (nn.Linear layout). `None` for a tied model's weights.
    pub lm_head: Option<Array2<f64>>,
}

/// A model: config, weights and the naming convention of the checkpoint it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Gpt2 {
    pub config: Gpt2Config,
    pub params: Params,
    /// `"transformer."` for `GPT2LMHeadModel` checkpoints, `""` for original hub files.
    pub prefix: String,
}

pub const LM_HEAD: &str = "lm_head.weight";

/// A block's tensors, by their names relative to `h.{layer}.`, in checkpoint order.
const BLOCK_PARTS: [&str; 12] = [
    "ln_1.weight",
    "ln_1.bias",
    "attn.c_attn.weight",
    "attn.c_attn.bias",
    "attn.c_proj.weight",
    "attn.c_proj.bias",
    "ln_2.weight",
    "ln_2.bias",
    "mlp.c_fc.weight",
    "mlp.c_fc.bias",
    "mlp.c_proj.weight",
    "mlp.c_proj.bias",
];

impl Params {
    pub fn zeros(cfg: &Gpt2Config, with_head: bool) -> Self {
        let (d, i) = (cfg.n_embd, cfg.n_inner);
        let ln = || LayerNorm {
            weight: Array1::zeros(d),
            bias: Array1::zeros(d),
        };
        let conv = |a, b| Conv1d {
            weight: Array2::zeros((a, b)),
            bias: Array1::zeros(b),
        };
        Params {
            wte: Array2::zeros((cfg.vocab_size, d)),
            wpe: Array2::zeros((cfg.n_positions, d)),
            blocks: (0..cfg.n_layer)
                .map(|_| Block {
                    ln_1: ln(),
                    c_attn: conv(d, 3 * d),
                    attn_proj: conv(d, d),
                    ln_2: ln(),
                    c_fc: conv(d, i),
                    mlp_proj: conv(i, d),
                })
                .collect(),
            ln_f: ln(),
            lm_head: with_head.then(|| Array2::zeros((cfg.vocab_size, d))),
        }
    }

    /// (name, shape) of every tensor of a config, in `tensors()` order, without allocating.
    pub fn layout(cfg: &Gpt2Config, with_head: bool) -> Vec<(String, Vec<usize>)> {
        let (v, p, d, i) = (cfg.vocab_size, cfg.n_positions, cfg.n_embd, cfg.n_inner);
        let mut out = vec![
            ("wte.weight".to_string(), vec![v, d]),
            ("wpe.weight".to_string(), vec![p, d]),
        ];
        for l in 0..cfg.n_layer {
            let shapes: [Vec<usize>; 12] = [
                vec![d],
                vec![d],
                vec![d, 3 * d],
                vec![3 * d],
                vec![d, d],
                vec![d],
                vec![d],
                vec![d],
                vec![d, i],
                vec![i],
                vec![i, d],
                vec![d],
            ];
            for (local, shape) in BLOCK_PARTS.iter().zip(shapes) {
                out.push((format!("h.{l}.{local}"), shape));
            }
        }
        out.push(("ln_f.weight".into(), vec![d]));
        out.push(("ln_f.bias".into(), vec![d]));
        if with_head {
            out.push((LM_HEAD.into(), vec![v, d]));
        }
        out
    }

    /// Every tensor with its name relative to the transformer (`lm_head.weight` last).
    pub fn tensors(&self) -> Vec<(String, ArrayViewD<'_, f64>)> {
        let mut out = vec![
            ("wte.weight".to_string(), self.wte.view().into_dyn()),
            ("wpe.weight".to_string(), self.wpe.view().into_dyn()),
        ];
        for (l, b) in self.blocks.iter().enumerate() {
            for (local, w) in block_parts(b) {
                out.push((format!("h.{l}.{local}"), w));
            }
        }
        out.push(("ln_f.weight".into(), self.ln_f.weight.view().into_dyn()));
        out.push(("ln_f.bias".into(), self.ln_f.bias.view().into_dyn()));
        if let Some(h) = &self.lm_head {
            out.push((LM_HEAD.into(), h.view().into_dyn()));
        }
        out
    }

    pub fn tensors_mut(&mut self) -> Vec<(String, ArrayViewMutD<'_, f64>)> {
        let mut out = vec![
            ("wte.weight".to_string(), self.wte.view_mut().into_dyn()),
            ("wpe.weight".to_string(), self.wpe.view_mut().into_dyn()),
        ];
        for (l, b) in self.blocks.iter_mut().enumerate() {
            let parts: [ArrayViewMutD<f64>; 12] = [
                b.ln_1.weight.view_mut().into_dyn(),
                b.ln_1.bias.view_mut().into_dyn(),
                b.c_attn.weight.view_mut().into_dyn(),
                b.c_attn.bias.view_mut().into_dyn(),
                b.attn_proj.weight.view_mut().into_dyn(),
                b.attn_proj.bias.view_mut().into_dyn(),
                b.ln_2.weight.view_mut().into_dyn(),
                b.ln_2.bias.view_mut().into_dyn(),
                b.c_fc.weight.view_mut().into_dyn(),
                b.c_fc.bias.view_mut().into_dyn(),
                b.mlp_proj.weight.view_mut().into_dyn(),
                b.mlp_proj.bias.view_mut().into_dyn(),
            ];
            for (local, w) in BLOCK_PARTS.iter().zip(parts) {
                out.push((format!("h.{l}.{local}"), w));
            }
        }
        out.push(("ln_f.weight".into(), self.ln_f.weight.view_mut().into_dyn()));
        out.push(("ln_f.bias".into(), self.ln_f.bias.view_mut().into_dyn()));
        if let Some(h) = &mut self.lm_head {
            out.push((LM_HEAD.into(), h.view_mut().into_dyn()));
        }
        out
    }
}

fn block_parts(b: &Block) -> impl Iterator<Item = (&'static str, ArrayViewD<'_, f64>)> {
    let views: [ArrayViewD<f64>; 12] = [
        b.ln_1.weight.view().into_dyn(),
        b.ln_1.bias.view().into_dyn(),
        b.c_attn.weight.view().into_dyn(),
        b.c_attn.bias.view().into_dyn(),
        b.attn_proj.weight.view().into_dyn(),
        b.attn_proj.bias.view().into_dyn(),
        b.ln_2.weight.view().into_dyn(),
        b.ln_2.bias.view().into_dyn(),
        b.c_fc.weight.view().into_dyn(),
        b.c_fc.bias.view().into_dyn(),
        b.mlp_proj.weight.view().into_dyn(),
        b.mlp_proj.bias.view().into_dyn(),
    ];
    BLOCK_PARTS.into_iter().zip(views)
}

impl Gpt2 {
    /// A seeded model with no files. Matrices are N(0, init_std²); LayerNorm weights 1 + N(0, 0.1²)
    /// and biases N(0, 0.1²) so that every parameter, LayerNorm included, has a generic gradient.
    pub fn random(config: Gpt2Config, seed: u64, init_std: f64) -> Self {
        let mut rng = SplitMix64::new(seed);
        let mut params = Params::zeros(&config, !config.tie_word_embeddings);
        for (name, mut t) in params.tensors_mut() {
            let is_ln = name.contains("ln_");
            let is_ln_weight = is_ln && name.ends_with("weight");
            for v in t.iter_mut() {
                *v = if is_ln_weight {
                    1.0 + 0.1 * rng.normal()
                } else if is_ln {
                    0.1 * rng.normal()
                } else {
                    init_std * rng.normal()
                };
            }
        }
        Gpt2 {
            config,
            params,
            prefix: "transformer.".into(),
        }
    }

    /// Checkpoint name of a parameter given its transformer-relative name.
    pub fn param_name(&self, local: &str) -> String {
        if local == LM_HEAD {
            LM_HEAD.to_string()
        } else {
            format!("{}{local}", self.prefix)
        }
    }

    /// Checkpoint name of the tensor that the LM head reads: `wte` when tied.
    pub fn head_param_name(&self) -> String {
        if self.config.tie_word_embeddings {
            self.param_name("wte.weight")
        } else {
            LM_HEAD.to_string()
        }
    }

    /// The head matrix (V×d), whichever tensor holds it.
    pub fn head(&self) -> &Array2<f64> {
        self.params.lm_head.as_ref().unwrap_or(&self.params.wte)
    }

    /// Loads `config.json` and `model.safetensors` from an HF checkpoint directory.
    pub fn load(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            bail!(
                "model directory {} does not exist or is not a directory",
                dir.display()
            );
        }
        let config = Gpt2Config::from_file(&dir.join("config.json"))?;
        let path = dir.join("model.safetensors");
        let bytes = tensors::read_bytes(&path, "checkpoint")?;
        Self::from_parts(config, &bytes, &path.display().to_string())
    }

    /// Builds a model from a parsed config and the contents of `model.safetensors`.
    pub fn from_parts(config: Gpt2Config, bytes: &[u8], label: &str) -> Result<Self> {
        let st = tensors::parse(bytes, label)?;
        let prefix = if tensors::has(&st, "transformer.wte.weight") {
            "transformer."
        } else if tensors::has(&st, "wte.weight") {
            ""
        } else {
            bail!("{label}: neither `transformer.wte.weight` nor `wte.weight` is present; is this a GPT-2 checkpoint?");
        };
        let has_head = tensors::has(&st, LM_HEAD);
        if !config.tie_word_embeddings && !has_head {
            bail!("{label}: config says tie_word_embeddings = false but tensor `{LM_HEAD}` is missing");
        }
        // Every tensor is checked against the header before anything is allocated: a config can
        // claim any size, but only tensors actually present in the file (so bounded by its
        // length) are ever built.
        for (local, shape) in Params::layout(&config, !config.tie_word_embeddings) {
            let name = if local == LM_HEAD {
                local.clone()
            } else {
                format!("{prefix}{local}")
            };
            let view = st
                .tensor(&name)
                .map_err(|_| Error::new(format!("{label}: tensor `{name}` is missing")))?;
            if view.shape() != shape.as_slice() {
                bail!(
                    "{label}: tensor `{name}` has shape {:?}; config.json implies {:?}",
                    view.shape(),
                    shape
                );
            }
        }
        let mut params = Params::zeros(&config, !config.tie_word_embeddings);
        let mut expected: Vec<String> = Vec::new();
        for (local, mut slot) in params.tensors_mut() {
            let name = if local == LM_HEAD {
                local.clone()
            } else {
                format!("{prefix}{local}")
            };
            let t = tensors::to_f64(&st, &name, label)?;
            if t.shape() != slot.shape() {
                bail!(
                    "{label}: tensor `{name}` has shape {:?}; config.json implies {:?}",
                    t.shape(),
                    slot.shape()
                );
            }
            slot.assign(&t);
            expected.push(name);
        }
        let model = Gpt2 {
            config,
            params,
            prefix: prefix.into(),
        };
        for name in st.names() {
            let known = expected.iter().any(|e| e == name)
                || name.ends_with(".attn.bias")
                || name.ends_with(".attn.masked_bias");
            if known {
                continue;
            }
            if name == LM_HEAD && model.config.tie_word_embeddings {
                // A tied checkpoint may still carry a copy of the head; it must be that copy.
                let head = tensors::to_f64(&st, LM_HEAD, label)?;
                if head.view() != model.params.wte.view().into_dyn() {
                    bail!("{label}: tie_word_embeddings is true but `{LM_HEAD}` differs from `{prefix}wte.weight`");
                }
                continue;
            }
            bail!("{label}: unexpected tensor `{name}` (not a GPT-2 parameter of this config)");
        }
        Ok(model)
    }

    /// Writes `config.json` and `model.safetensors` (f64 or f32) the way `save_pretrained` lays
    /// them out, so that tests and examples can produce real checkpoints.
    pub fn save(&self, dir: &Path, f32_weights: bool) -> Result<()> {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::new(format!("cannot create {}: {e}", dir.display())))?;
        let cfg = serde_json::to_string_pretty(&self.config.to_json()).expect("config serializes");
        std::fs::write(dir.join("config.json"), cfg).map_err(|e| {
            Error::new(format!(
                "cannot write {}: {e}",
                dir.join("config.json").display()
            ))
        })?;
        let named: Vec<(String, ArrayViewD<f64>)> = self
            .params
            .tensors()
            .into_iter()
            .map(|(local, t)| (self.param_name(&local), t))
            .collect();
        crate::io::write_f64_tensors(&dir.join("model.safetensors"), &named, f32_weights, None)
    }
}
