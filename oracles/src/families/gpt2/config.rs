//! GPT-2's `config.json`.

use crate::error::{bail, Result};
use crate::keys::{check_parameter_count, Keys};
use serde_json::Value;

/// The GPT-2 hyper-parameters the reference needs, with Hugging Face's defaults for absent keys.
#[derive(Clone, Debug, PartialEq)]
pub struct Gpt2Config {
    /// V, the number of token ids.
    pub vocab_size: usize,
    /// Rows of the learned position table: the longest sequence the model accepts.
    pub n_positions: usize,
    /// d, the width of the residual stream.
    pub n_embd: usize,
    /// Number of blocks.
    pub n_layer: usize,
    /// Attention heads per block; d is a multiple of it.
    pub n_head: usize,
    /// MLP width; HF's `n_inner: null` means 4·n_embd.
    pub n_inner: usize,
    /// ε added to the variance in every LayerNorm.
    pub layer_norm_epsilon: f64,
    /// Whether the LM head is the token embedding `wte`.
    pub tie_word_embeddings: bool,
    /// Whether attention scores are divided by √head_dim.
    pub scale_attn_weights: bool,
    /// Whether layer i's attention scores are also divided by i + 1.
    pub scale_attn_by_inverse_layer_idx: bool,
}

impl Gpt2Config {
    /// A small model for tests and built-in suites.
    pub fn tiny(
        vocab_size: usize,
        n_positions: usize,
        n_embd: usize,
        n_layer: usize,
        n_head: usize,
    ) -> Self {
        Gpt2Config {
            vocab_size,
            n_positions,
            n_embd,
            n_layer,
            n_head,
            n_inner: 4 * n_embd,
            layer_norm_epsilon: 1e-5,
            tie_word_embeddings: true,
            scale_attn_weights: true,
            scale_attn_by_inverse_layer_idx: false,
        }
    }

    /// The same config with its own LM head.
    pub fn untied(mut self) -> Self {
        self.tie_word_embeddings = false;
        self
    }

    /// Width of one attention head, d / n_head.
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// Parses a GPT-2 `config.json`, with HF's defaults for the keys it leaves out.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let keys = Keys::parse(text)?;
        if let Some(model_type) = keys.value("model_type").and_then(Value::as_str) {
            if model_type != "gpt2" {
                bail!(
                    "`model_type` is \"{model_type}\"; this loader reads only \"gpt2\" (loading a `Model` also reads \"llama\" and \"qwen2\")"
                );
            }
        }
        match keys.value("activation_function").map(|a| a.as_str()) {
            None | Some(Some("gelu_new")) | Some(Some("gelu_pytorch_tanh")) => {}
            Some(other) => bail!(
                "`activation_function` is {}; only \"gelu_new\" (the tanh form GPT-2 uses) is supported",
                other.map(|s| format!("\"{s}\"")).unwrap_or_else(|| "not a string".into())
            ),
        }
        let n_embd = keys.usize("n_embd", 768)?;
        let n_head = keys.usize("n_head", 12)?;
        if n_embd % n_head != 0 {
            bail!("`n_embd` ({n_embd}) is not a multiple of `n_head` ({n_head})");
        }
        let eps = keys.positive("layer_norm_epsilon", 1e-5)?;
        let n_layer = keys.layers("n_layer", 12)?;
        let cfg = Gpt2Config {
            vocab_size: keys.usize("vocab_size", 50257)?,
            n_positions: keys.usize("n_positions", 1024)?,
            n_embd,
            n_layer,
            n_head,
            n_inner: keys.usize("n_inner", 4 * n_embd)?,
            layer_norm_epsilon: eps,
            tie_word_embeddings: keys.bool("tie_word_embeddings", true)?,
            scale_attn_weights: keys.bool("scale_attn_weights", true)?,
            scale_attn_by_inverse_layer_idx: keys.bool("scale_attn_by_inverse_layer_idx", false)?,
        };
        check_parameter_count(cfg.parameter_count())?;
        Ok(cfg)
    }

    /// Number of trainable scalars (the tied head counted once).
    pub fn parameter_count(&self) -> usize {
        let (d, i) = (self.n_embd, self.n_inner);
        let block = 4 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * i + i) + (i * d + d);
        let head = if self.tie_word_embeddings {
            0
        } else {
            self.vocab_size * d
        };
        self.vocab_size * d + self.n_positions * d + self.n_layer * block + 2 * d + head
    }

    /// The config as `config.json` (what [`Gpt2Config::from_json_str`] reads back).
    pub fn to_json(&self) -> Value {
        serde_json::json!({
            "model_type": "gpt2",
            "vocab_size": self.vocab_size,
            "n_positions": self.n_positions,
            "n_embd": self.n_embd,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_inner": self.n_inner,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "tie_word_embeddings": self.tie_word_embeddings,
            "scale_attn_weights": self.scale_attn_weights,
            "scale_attn_by_inverse_layer_idx": self.scale_attn_by_inverse_layer_idx,
            "activation_function": "gelu_new",
        })
    }
}
