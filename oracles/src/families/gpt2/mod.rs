//! GPT-2 (HF `GPT2LMHeadModel`) as an instance of the decoder skeleton: parameters in f64 by the
//! names Hugging Face gives them, learned positions, LayerNorm, fused-QKV Conv1D attention and a
//! `gelu_new` MLP.
//!
//! `config` reads and writes `config.json`; `params` holds the parameters and the one table of a
//! block's tensors; `block` a block's forward and backward passes and the sites they record; this
//! module the model and its loading.

mod block;
mod config;
mod params;

pub use config::Gpt2Config;
pub use params::Gpt2Params;

use crate::checkpoint::{
    read_checkpoint, write_checkpoint, Blocks, CheckpointLayout, FromCheckpoint,
};
use crate::decoder::{DecoderModel, Dims, HasDims, LM_HEAD};
use crate::error::{bail, Result};
use crate::rng::SplitMix64;
use crate::tensors::TensorSource;
use ndarray::Array2;
use params::WTE;
use std::path::Path;

/// A model: config, weights and the naming convention of the checkpoint it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Gpt2 {
    /// The model's hyperparameters.
    pub config: Gpt2Config,
    /// The weights.
    pub params: Gpt2Params,
    /// `"transformer."` for `GPT2LMHeadModel` checkpoints, `""` for original hub files.
    pub prefix: String,
}

impl Gpt2 {
    /// A seeded model with no files. Matrices are N(0, init_std²); LayerNorm weights 1 + N(0, 0.1²)
    /// and biases N(0, 0.1²) so that every parameter, LayerNorm included, has a generic gradient.
    pub fn random(config: Gpt2Config, seed: u64, init_std: f64) -> Self {
        let mut rng = SplitMix64::new(seed);
        let mut params = Gpt2Params::zeros(&config, !config.tie_word_embeddings);
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
        DecoderModel::head_param_name(self)
    }

    /// The head matrix (V×d), whichever tensor holds it.
    pub fn head(&self) -> &Array2<f64> {
        DecoderModel::head(self)
    }

    /// Builds a model from a parsed config and the contents of `model.safetensors`.
    pub fn from_parts(config: Gpt2Config, bytes: &[u8], label: &str) -> Result<Self> {
        Self::build(config, bytes, label)
    }

    /// GPT-2 keeps its blocks resident whatever `Blocks` asks: its largest sizes fit in f64.
    fn from_source(config: Gpt2Config, st: &dyn TensorSource, label: &str) -> Result<Self> {
        let prefix = if st.has("transformer.wte.weight") {
            "transformer."
        } else if st.has("wte.weight") {
            ""
        } else {
            bail!("{label}: neither `transformer.wte.weight` nor `wte.weight` is present; is this a GPT-2 checkpoint?");
        };
        let untied = !config.tie_word_embeddings;
        let name = |local: &str| {
            if local == LM_HEAD {
                local.to_string()
            } else {
                format!("{prefix}{local}")
            }
        };
        let layout: Vec<(String, Vec<usize>)> = Gpt2Params::layout(&config, untied)
            .into_iter()
            .map(|(local, shape)| (name(&local), shape))
            .collect();
        let spec = CheckpointLayout {
            layout: &layout,
            layers: config.n_layer,
            block: Vec::new(),
            block_name: &|_, n| n.to_string(),
        };
        let (params, _) = read_checkpoint(
            st,
            label,
            &spec,
            Blocks::Resident,
            |_| Gpt2Params::zeros(&config, untied),
            |n| n.ends_with(".attn.bias") || n.ends_with(".attn.masked_bias"),
            config.tie_word_embeddings.then(|| name(WTE)),
            "GPT-2",
        )?;
        Ok(Gpt2 {
            config,
            params,
            prefix: prefix.into(),
        })
    }

    /// Writes `config.json` and `model.safetensors` (f64 or f32) the way `save_pretrained` lays
    /// them out, so that tests and examples can produce real checkpoints.
    pub fn save(&self, dir: &Path, f32_weights: bool) -> Result<()> {
        write_checkpoint(self, &self.config.to_json(), dir, f32_weights)
    }
}

impl HasDims for Gpt2Config {
    fn dims(&self) -> Dims {
        Dims {
            vocab_size: self.vocab_size,
            max_positions: self.n_positions,
            positions_key: "n_positions",
            hidden_size: self.n_embd,
            layers: self.n_layer,
            tie_word_embeddings: self.tie_word_embeddings,
        }
    }
}

impl HasDims for Gpt2 {
    fn dims(&self) -> Dims {
        self.config.dims()
    }
}

impl FromCheckpoint for Gpt2 {
    type Config = Gpt2Config;

    fn parse_config(text: &str) -> Result<Gpt2Config> {
        Gpt2Config::from_json_str(text)
    }

    fn build_from(
        config: Gpt2Config,
        src: &dyn TensorSource,
        label: &str,
        _blocks: Blocks,
    ) -> Result<Gpt2> {
        Gpt2::from_source(config, src, label)
    }
}
