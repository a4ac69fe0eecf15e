"""Random-weights GGUF models (llama architecture, SentencePiece vocabulary with
fill-in-the-middle tokens), written with the `gguf` package. Never committed, never
downloaded: the tests write `tiny` ones; `deploy/gpu-check.sh` writes one of realistic
shape for a GPU box that cannot carry a real model. Its text is noise, its speed real.

    python -m workers.synthetic_model OUT.gguf --shape 1b
"""
from __future__ import annotations

import argparse
import string
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FIM_TOKENS = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")
REPO_TOKENS = ("<repo_name>", "<file_sep>")      # FIM_REP, FIM_SEP (repository-level FIM)


@dataclass(frozen=True)
class Shape:
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_vocab: int | None      # None: just the base vocabulary (a few hundred tokens)
    n_ctx: int
    f16: bool                # weights in F16 (as a GPU box would serve); else F32

    @property
    def parameters(self) -> int:
        head = self.n_embd // self.n_head
        attention = 2 * self.n_embd * self.n_embd + 2 * self.n_embd * head * self.n_head_kv
        vocab = self.n_vocab or len(vocabulary()[0])
        return 2 * vocab * self.n_embd + self.n_layer * (attention + 3 * self.n_embd * self.n_ff)


SHAPES = {
    "tiny": Shape(32, 1, 64, 2, 2, None, 512, False),            # the tests' model
    "small": Shape(768, 12, 3072, 12, 4, 32000, 4096, True),     # ~0.15B
    "1b": Shape(2048, 16, 8192, 32, 8, 32000, 8192, True),       # ~1.1B, 2.2 GB (Llama 3.2 1B)
    "7b": Shape(4096, 32, 14336, 32, 8, 32000, 8192, True),      # ~7B, 14 GB (a 7B code model)
}


def vocabulary(repo: bool = False, size: int | None = None
               ) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, types): unk, bos, eos, the FIM tokens (and the repository ones),
    256 byte tokens, then single characters and short words; padded to `size` with
    two-letter pieces when asked."""
    normal, control, unknown, byte = 1, 3, 2, 6
    fim = FIM_TOKENS + (REPO_TOKENS if repo else ())
    tokens = ["<unk>", "<s>", "</s>", *fim]
    types = [unknown, control, control] + [control] * len(fim)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [byte] * 256
    words = ["▁"] + list(string.ascii_letters + string.digits + string.punctuation) + \
        ["▁" + w for w in ("def", "return", "if", "else", "for", "in", "the", "a", "x", "y")]
    if size is not None:
        seen = set(words)
        letters = string.ascii_lowercase + string.digits + "_"
        for i in range(max(0, size - len(tokens) - len(words))):
            piece = "▁" if i % 2 else ""
            n = i // 2
            while True:                    # base-37 spelling of n: unique per i
                piece += letters[n % len(letters)]
                n //= len(letters)
                if n == 0:
                    break
            if piece in seen:
                piece += "_"
            seen.add(piece)
            words.append(piece)
    tokens += words
    types += [normal] * len(words)
    scores = [0.0] * (len(tokens) - len(words)) + [-float(i) for i in range(len(words))]
    return tokens, scores, types


def write_model(path: Path, shape: Shape, seed: int = 0, repo: bool = False,
                name: str = "synthetic") -> Path:
    import gguf

    tokens, scores, types = vocabulary(repo, shape.n_vocab)
    n_vocab, n_embd, n_ff = len(tokens), shape.n_embd, shape.n_ff
    head = n_embd // shape.n_head
    rng = np.random.default_rng(seed)
    dtype = np.float16 if shape.f16 else np.float32

    def weights(*dims):     # float64 draws for the small F32 models (as they always were)
        draw = rng.standard_normal(dims, dtype=np.float32 if shape.f16 else np.float64)
        return (draw * 0.02).astype(dtype)

    def ones(n):
        return np.ones(n, dtype=np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_context_length(shape.n_ctx)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_rope_dimension_count(head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if shape.f16
                         else gguf.LlamaFileType.ALL_F32)
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
    writer.add_tensor("output_norm.weight", ones(n_embd))
    writer.add_tensor("output.weight", weights(n_vocab, n_embd))
    for layer in range(shape.n_layer):
        block = f"blk.{layer}"
        writer.add_tensor(f"{block}.attn_norm.weight", ones(n_embd))
        writer.add_tensor(f"{block}.attn_q.weight", weights(n_embd, n_embd))
        writer.add_tensor(f"{block}.attn_k.weight", weights(head * shape.n_head_kv, n_embd))
        writer.add_tensor(f"{block}.attn_v.weight", weights(head * shape.n_head_kv, n_embd))
        writer.add_tensor(f"{block}.attn_output.weight", weights(n_embd, n_embd))
        writer.add_tensor(f"{block}.ffn_norm.weight", ones(n_embd))
        writer.add_tensor(f"{block}.ffn_gate.weight", weights(n_ff, n_embd))
        writer.add_tensor(f"{block}.ffn_up.weight", weights(n_ff, n_embd))
        writer.add_tensor(f"{block}.ffn_down.weight", weights(n_embd, n_ff))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.synthetic_model",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise SystemExit("the gguf package is needed: pip install gguf") from None
    shape = SHAPES[args.shape]
    write_model(args.path, shape, args.seed, name=f"synthetic-{args.shape}")
    print(f"{args.path}: {args.shape}, {shape.parameters / 1e9:.2f}B parameters, "
          f"{args.path.stat().st_size / (1 << 20):.0f} MiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
