"""The random-weight models the device scripts time transformers on: the Llama-3.1-8B geometry that
`veloq bench runner`'s `llama8b` and `--model synthetic:llama8b` use, and a two-layer one for
checking a script on the CPU. One definition, so the anchors cannot drift from each other."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def llama8b_config(longest: int) -> LlamaConfig:
    """Llama-3.1-8B's geometry, `longest` positions."""
    return LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=longest,
        rope_theta=500000.0, tie_word_embeddings=False,
    )


def tiny_config(longest: int) -> LlamaConfig:
    """Two layers, GQA 4:2, head dim 16: a script's logic on the CPU in seconds."""
    return LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=longest,
    )


def random_model(cfg: LlamaConfig, dtype: torch.dtype, device: str = "cuda") -> LlamaForCausalLM:
    """`cfg` with weights drawn from seed 0, built in `dtype` on `device`, in eval mode."""
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    return model.eval()
