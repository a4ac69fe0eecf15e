"""Write a tiny GGUF model (random weights, llama architecture, SentencePiece vocabulary)
that declares fill-in-the-middle tokens. Generated at test time, never committed."""
from __future__ import annotations

import string
from pathlib import Path

import numpy as np

FIM_TOKENS = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")
REPO_TOKENS = ("<repo_name>", "<file_sep>")      # FIM_REP, FIM_SEP (repository-level FIM)


def vocabulary(repo: bool = False) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, types): unk, bos, eos, the FIM tokens (and the repository ones),
    256 byte tokens, then a few hundred single characters and short words."""
    normal, control, unknown, byte = 1, 3, 2, 6
    fim = FIM_TOKENS + (REPO_TOKENS if repo else ())
    tokens = ["<unk>", "<s>", "</s>", *fim]
    types = [unknown, control, control] + [control] * len(fim)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [byte] * 256
    words = ["▁"] + list(string.ascii_letters + string.digits + string.punctuation) + \
        ["▁" + w for w in ("def", "return", "if", "else", "for", "in", "the", "a", "x", "y")]
    tokens += words
    types += [normal] * len(words)
    scores = [0.0] * (len(tokens) - len(words)) + [-float(i) for i in range(len(words))]
    return tokens, scores, types


def write_tiny_fim_model(path: Path, seed: int = 0, repo: bool = False) -> Path:
    import gguf

    n_embd, n_ff, n_head, n_ctx = 32, 64, 2, 512
    tokens, scores, types = vocabulary(repo)
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)

    def weights(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-fim-test")
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(1)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    for key, token in zip(("fim_pre", "fim_suf", "fim_mid"), FIM_TOKENS):
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id", tokens.index(token))
    if repo:
        for key, token in zip(("fim_rep", "fim_sep"), REPO_TOKENS):
            writer.add_uint32(f"tokenizer.ggml.{key}_token_id", tokens.index(token))
    writer.add_tensor("token_embd.weight", weights(n_vocab, n_embd))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", weights(n_vocab, n_embd))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        writer.add_tensor(f"blk.0.{name}.weight", weights(n_embd, n_embd))
    writer.add_tensor("blk.0.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("blk.0.ffn_gate.weight", weights(n_ff, n_embd))
    writer.add_tensor("blk.0.ffn_up.weight", weights(n_ff, n_embd))
    writer.add_tensor("blk.0.ffn_down.weight", weights(n_embd, n_ff))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
