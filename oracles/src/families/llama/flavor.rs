//! The members of the Llama-shaped family and the properties each one fixes: where the norms
//! sit, per-head norms, Gemma's conventions, the config class's defaults.

/// Which member of the family: it fixes the biases, the norms, the activation and the keys that
/// are read. Every property below is an exhaustive match, so a new member is a compile error
/// until each is decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlamaFlavor {
    /// `model_type: "llama"`: `attention_bias` on all four projections, `mlp_bias` on the MLP.
    Llama,
    /// `model_type: "qwen2"`: q/k/v biases always, no o_proj bias, no MLP bias.
    Qwen2,
    /// `model_type: "qwen3"`: Llama's `attention_bias`, no MLP bias, and an RMSNorm over each
    /// query and key head (`q_norm`, `k_norm`) before the rotary.
    Qwen3,
    /// `model_type: "gemma"`: Llama's block with Gemma's conventions (see [`Self::is_gemma`]).
    Gemma,
    /// `model_type: "gemma2"`: Gemma with norms after attention and MLP too, soft-capping and
    /// sliding-window layers.
    Gemma2,
    /// `model_type: "gemma3_text"`: Gemma 2's block with per-head q/k norms and a rope base of
    /// its own for sliding-window layers.
    Gemma3Text,
    /// `model_type: "vaultgemma"`: Gemma 2 without the two norms after attention and MLP.
    VaultGemma,
}

/// Where a block's RMSNorms sit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormLayout {
    /// `input_layernorm` before attention, `post_attention_layernorm` before the MLP (Llama).
    PreNorm,
    /// `input_layernorm` and `pre_feedforward_layernorm` before attention and MLP,
    /// `post_attention_layernorm` and `post_feedforward_layernorm` on their outputs, before the
    /// residual sum (Gemma 2 and 3).
    Sandwich,
    /// `input_layernorm` and `pre_feedforward_layernorm` only (VaultGemma).
    PreFeedforward,
}

/// Whether a layer attends to every earlier position or to a window of them (`layer_types`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerType {
    /// Causal attention over every earlier position.
    Full,
    /// Causal attention over the last `sliding_window` positions.
    Sliding,
}

impl LayerType {
    /// The name `layer_types` gives it in `config.json`.
    pub fn name(self) -> &'static str {
        match self {
            LayerType::Full => "full_attention",
            LayerType::Sliding => "sliding_attention",
        }
    }
}

impl LlamaFlavor {
    /// Every flavor, in the order they are listed to a person.
    pub const ALL: [LlamaFlavor; 7] = [
        LlamaFlavor::Llama,
        LlamaFlavor::Qwen2,
        LlamaFlavor::Qwen3,
        LlamaFlavor::Gemma,
        LlamaFlavor::Gemma2,
        LlamaFlavor::Gemma3Text,
        LlamaFlavor::VaultGemma,
    ];

    /// The `model_type` of the flavor's `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            LlamaFlavor::Llama => "llama",
            LlamaFlavor::Qwen2 => "qwen2",
            LlamaFlavor::Qwen3 => "qwen3",
            LlamaFlavor::Gemma => "gemma",
            LlamaFlavor::Gemma2 => "gemma2",
            LlamaFlavor::Gemma3Text => "gemma3_text",
            LlamaFlavor::VaultGemma => "vaultgemma",
        }
    }

    /// The HF class a checkpoint of this flavor is saved from, for messages.
    pub fn class_name(self) -> &'static str {
        match self {
            LlamaFlavor::Llama => "LlamaForCausalLM",
            LlamaFlavor::Qwen2 => "Qwen2ForCausalLM",
            LlamaFlavor::Qwen3 => "Qwen3ForCausalLM",
            LlamaFlavor::Gemma => "GemmaForCausalLM",
            LlamaFlavor::Gemma2 => "Gemma2ForCausalLM",
            LlamaFlavor::Gemma3Text => "Gemma3ForCausalLM",
            LlamaFlavor::VaultGemma => "VaultGemmaForCausalLM",
        }
    }

    /// The flavor whose `model_type` is `s`, if one is.
    pub fn from_model_type(s: &str) -> Option<Self> {
        LlamaFlavor::ALL.into_iter().find(|f| f.model_type() == s)
    }

    /// Gemma's conventions: the embedding scaled by √d, RMSNorm as x̂ ⊙ (1 + w), GeGLU with
    /// `gelu_pytorch_tanh` instead of SwiGLU.
    pub fn is_gemma(self) -> bool {
        match self {
            LlamaFlavor::Llama | LlamaFlavor::Qwen2 | LlamaFlavor::Qwen3 => false,
            LlamaFlavor::Gemma
            | LlamaFlavor::Gemma2
            | LlamaFlavor::Gemma3Text
            | LlamaFlavor::VaultGemma => true,
        }
    }

    /// An RMSNorm over each query and key head (`self_attn.q_norm`, `self_attn.k_norm`, one
    /// weight of head_dim shared by every head and position), before the rotary.
    pub fn head_norms(self) -> bool {
        match self {
            LlamaFlavor::Qwen3 | LlamaFlavor::Gemma3Text => true,
            LlamaFlavor::Llama
            | LlamaFlavor::Qwen2
            | LlamaFlavor::Gemma
            | LlamaFlavor::Gemma2
            | LlamaFlavor::VaultGemma => false,
        }
    }

    /// Where the flavor's blocks put their RMSNorms.
    pub fn norm_layout(self) -> NormLayout {
        match self {
            LlamaFlavor::Llama | LlamaFlavor::Qwen2 | LlamaFlavor::Qwen3 | LlamaFlavor::Gemma => {
                NormLayout::PreNorm
            }
            LlamaFlavor::Gemma2 | LlamaFlavor::Gemma3Text => NormLayout::Sandwich,
            LlamaFlavor::VaultGemma => NormLayout::PreFeedforward,
        }
    }

    /// What an RMSNorm adds to its weight before scaling: 1 for Gemma's x̂ ⊙ (1 + w).
    pub fn norm_offset(self) -> f64 {
        if self.is_gemma() {
            1.0
        } else {
            0.0
        }
    }

    /// Hugging Face's defaults for absent keys, which differ from config class to config class.
    pub(crate) fn defaults(self) -> Defaults {
        let d = |vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, max_pos, tie| {
            Defaults {
                vocab,
                hidden,
                intermediate,
                layers,
                heads,
                kv_heads,
                head_dim,
                max_pos,
                tie,
            }
        };
        match self {
            LlamaFlavor::Llama => d(32000, 4096, 11008, 32, 32, None, None, 2048, false),
            LlamaFlavor::Qwen2 => d(151936, 4096, 22016, 32, 32, None, None, 32768, false),
            LlamaFlavor::Qwen3 => d(
                151936,
                4096,
                22016,
                32,
                32,
                Some(32),
                Some(128),
                32768,
                false,
            ),
            LlamaFlavor::Gemma => d(256000, 3072, 24576, 28, 16, Some(16), Some(256), 8192, true),
            LlamaFlavor::Gemma2 | LlamaFlavor::VaultGemma => {
                d(256000, 2304, 9216, 26, 8, Some(4), Some(256), 8192, true)
            }
            LlamaFlavor::Gemma3Text => {
                d(262208, 2304, 9216, 26, 8, Some(4), Some(256), 131072, true)
            }
        }
    }
}

/// A config class's defaults; `None` for kv heads = the query heads, for head_dim = hidden / heads.
pub(crate) struct Defaults {
    pub(crate) vocab: usize,
    pub(crate) hidden: usize,
    pub(crate) intermediate: usize,
    pub(crate) layers: usize,
    pub(crate) heads: usize,
    pub(crate) kv_heads: Option<usize>,
    pub(crate) head_dim: Option<usize>,
    pub(crate) max_pos: usize,
    pub(crate) tie: bool,
}
