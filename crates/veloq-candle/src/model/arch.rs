//! Architectures as data: one descriptor per GGUF family says where its norms sit, how it rotates
//! positions, which layers slide and which chat template it falls back to (fused q/k/v or gate/up
//! matrices, as Phi-3 stores them, are found by their tensor names). The decoder reads the
//! descriptor and the file's metadata, never the family's name, so a new family is a new constant
//! here (and a fixture with its reference forward pass in `tests/`).

use tokenizers::Tokenizer;

use super::template::ChatTemplate;
use crate::error::{Error, Result};

/// How RoPE pairs a head's channels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Channels `2i, 2i + 1` (Llama as llama.cpp's converter lays its q/k weights out).
    Interleaved,
    /// Channels `i, i + D/2` (GPT-NeoX: Qwen, Gemma, Phi-3).
    NeoX,
}

/// The MLP's gate activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (SwiGLU).
    Silu,
    /// GELU, tanh approximation (GeGLU: Gemma).
    GeluTanh,
}

/// Where the RMS norms sit in a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Norms {
    /// Before attention and before the MLP.
    Pre,
    /// Also on the attention and MLP outputs, before they join the residual stream (Gemma 3).
    PreAndPost,
}

/// Which layers attend only a sliding window of recent positions (the window itself comes from
/// `<arch>.attention.sliding_window`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sliding {
    /// Every layer sees every position.
    Never,
    /// Every layer slides, when the file names a window (Phi-3's 2,047 positions).
    AllLayers,
    /// Every `pattern`-th layer is global, the others slide (Gemma 3: `sliding_window_pattern`,
    /// 6 when absent).
    AllButEveryNth {
        /// The period when the file does not give `<arch>.attention.sliding_window_pattern`.
        default_pattern: usize,
    },
}

/// How the queries are scaled before the softmax.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueryScale {
    /// 1/√head_dim.
    HeadDim,
    /// Gemma 3: 1/√head_dim, but 1/√(hidden / heads) for the 27B model (`query_pre_attn_scalar`
    /// in Hugging Face's config, absent from GGUF; llama.cpp tells the 27B by its 62 layers too).
    Gemma3,
}

/// A family of decoders as its GGUF files describe it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Architecture {
    /// `general.architecture`, the prefix of the family's metadata keys.
    pub name: &'static str,
    /// How positions rotate queries and keys.
    pub rope: RopeStyle,
    /// The MLP's activation.
    pub activation: Activation,
    /// Per-head RMS norms on queries and keys before RoPE (`attn_q_norm`, `attn_k_norm`).
    pub qk_norm: bool,
    /// Where the block's norms sit.
    pub norms: Norms,
    /// Biases on q, k and v (Qwen2).
    pub qkv_bias: bool,
    /// Embeddings multiplied by √hidden (Gemma).
    pub embed_scale_sqrt_hidden: bool,
    /// Which layers slide.
    pub sliding: Sliding,
    /// RoPE base of sliding-window layers, when theirs differs from the file's (Gemma 3: 10,000).
    pub local_rope_base: Option<f32>,
    /// Global layers divide positions by `<arch>.rope.scaling.factor` (linear scaling: Gemma 3
    /// 4B and up).
    pub linear_rope_scaling: bool,
    /// How queries are scaled.
    pub query_scale: QueryScale,
    /// The chat template when the vocabulary's own markers do not tell (see
    /// [`ChatTemplate::detect`]).
    pub template: ChatTemplate,
}

const BASE: Architecture = Architecture {
    name: "llama",
    rope: RopeStyle::Interleaved,
    activation: Activation::Silu,
    qk_norm: false,
    norms: Norms::Pre,
    qkv_bias: false,
    embed_scale_sqrt_hidden: false,
    sliding: Sliding::Never,
    local_rope_base: None,
    linear_rope_scaling: false,
    query_scale: QueryScale::HeadDim,
    template: ChatTemplate::Raw,
};

/// Llama 2/3, SmolLM2, Mistral and Falcon3 as llama.cpp converts them.
pub const LLAMA: Architecture = BASE;
/// Mistral files that name their own architecture.
pub const MISTRAL: Architecture = Architecture { name: "mistral", ..BASE };
/// Qwen2 (and Qwen2.5): q/k/v biases, NeoX RoPE.
pub const QWEN2: Architecture =
    Architecture { name: "qwen2", rope: RopeStyle::NeoX, qkv_bias: true, template: ChatTemplate::ChatMl, ..BASE };
/// Qwen3: per-head q/k RMS norms, NeoX RoPE, no biases.
pub const QWEN3: Architecture =
    Architecture { name: "qwen3", rope: RopeStyle::NeoX, qk_norm: true, template: ChatTemplate::ChatMl, ..BASE };
/// Gemma 3: √hidden embeddings, q/k norms, post-norms, GeGLU, five sliding layers to a global one.
pub const GEMMA3: Architecture = Architecture {
    name: "gemma3",
    rope: RopeStyle::NeoX,
    activation: Activation::GeluTanh,
    qk_norm: true,
    norms: Norms::PreAndPost,
    embed_scale_sqrt_hidden: true,
    sliding: Sliding::AllButEveryNth { default_pattern: 6 },
    local_rope_base: Some(10_000.0),
    linear_rope_scaling: true,
    query_scale: QueryScale::Gemma3,
    template: ChatTemplate::Gemma,
    ..BASE
};
/// Phi-3 (mini, medium; 4k context): fused q/k/v and gate/up, NeoX RoPE, a sliding window on
/// every layer.
pub const PHI3: Architecture = Architecture {
    name: "phi3",
    rope: RopeStyle::NeoX,
    sliding: Sliding::AllLayers,
    template: ChatTemplate::Phi3,
    ..BASE
};

/// Every family the decoder runs.
pub const ARCHITECTURES: [Architecture; 6] = [LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA3, PHI3];

impl Architecture {
    /// The descriptor of GGUF architecture `name`.
    pub fn named(name: &str) -> Result<&'static Architecture> {
        ARCHITECTURES
            .iter()
            .find(|a| a.name == name)
            .ok_or_else(|| Error::Architecture { name: name.to_string(), supported: supported() })
    }

    /// Whether layer `layer` slides, for a file with a window and `pattern` (the
    /// `sliding_window_pattern` it gives, if any).
    pub fn slides(&self, layer: usize, pattern: Option<usize>) -> bool {
        match self.sliding {
            Sliding::Never => false,
            Sliding::AllLayers => true,
            Sliding::AllButEveryNth { default_pattern } => {
                !(layer + 1).is_multiple_of(pattern.unwrap_or(default_pattern).max(1))
            }
        }
    }

    /// The chat template of a model of this family with vocabulary `tok`: what its markers say,
    /// else the family's.
    pub fn chat_template(&self, tok: &Tokenizer) -> ChatTemplate {
        match ChatTemplate::detect(tok) {
            ChatTemplate::Raw => self.template,
            t => t,
        }
    }

    /// The query scale for a model of this family.
    pub fn query_scale(&self, head_dim: usize, hidden: usize, heads: usize, layers: usize) -> f64 {
        match self.query_scale {
            QueryScale::Gemma3 if layers == 62 => 1.0 / ((hidden / heads) as f64).sqrt(),
            _ => 1.0 / (head_dim as f64).sqrt(),
        }
    }
}

/// The list of supported names, for messages.
pub fn supported() -> String {
    ARCHITECTURES.iter().map(|a| a.name).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_are_found_by_name_and_slide_as_their_families_do() {
        assert_eq!(Architecture::named("qwen3").unwrap().name, "qwen3");
        let e = Architecture::named("mamba").unwrap_err().to_string();
        assert!(e.contains("mamba") && e.contains("phi3"), "{e}");
        // Gemma 3: layers 5, 11, … are global.
        let g = Architecture::named("gemma3").unwrap();
        let global: Vec<usize> = (0..12).filter(|&i| !g.slides(i, None)).collect();
        assert_eq!(global, vec![5, 11]);
        assert_eq!((0..4).filter(|&i| !g.slides(i, Some(2))).collect::<Vec<_>>(), vec![1, 3]);
        assert!((0..4).all(|i| PHI3.slides(i, None) && !LLAMA.slides(i, None)));
        assert_eq!(GEMMA3.query_scale(256, 640, 4, 18), 1.0 / 16.0);
        assert_eq!(GEMMA3.query_scale(128, 5376, 32, 62), 1.0 / 168f64.sqrt());
    }
}
