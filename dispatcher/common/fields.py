"""Every sampling and routing field of a request, declared once: its type, range, default,
the llama.cpp sampler it configures and the worker capability it routes by.

From this table come the request schema's fields (app.schemas: marshmallow fields with
their OpenAPI descriptions), the job's `sampling` (`sampling_of`, carried as
`protocol.Sampling`, a field per declaration), the worker's
`SamplingParams` (workers.sampling: its fields and defaults) and the job's `Route`
(`ROUTE`: request name -> capability name). A new sampling knob is one line here (and
its use in workers/engine/samplers.py); a new routing rule is one line here and one in
dispatcher.common.fit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

INT_MAX = 2 ** 31 - 1      # token counts and the like: anything larger is a mistake
RANDOM_SEED = 0xFFFFFFFF   # llama.cpp's LLAMA_DEFAULT_SEED: its uint32 seed meaning "draw one"


def random_seed(seed: int) -> bool:
    """Whether llama.cpp, reading `seed` as a uint32, draws a random seed for it."""
    return seed % 2 ** 32 == RANDOM_SEED
COMPUTE_KINDS = ("cpu", "gpu", "npu", "hybrid")

# llama.cpp's sampler names, in its order, as a request's `samplers` list may give them;
# its default chain is all of them but infill (which only FIM requests ask for).
SAMPLER_NAMES = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p",
                 "xtc", "temperature", "infill")
SAMPLER_ALIASES = {"typical_p": "typ_p", "typical": "typ_p", "nucleus": "top_p",
                   "temp": "temperature", "repetition": "penalties"}
DEFAULT_ORDER = tuple(name for name in SAMPLER_NAMES if name != "infill")
DRY_BREAKERS = ("\n", ":", "\"", "*")
# a logit_bias key that is text, not a token id (llama.cpp's `[["Hello", -0.5]]`): the
# worker biases each of its tokens
TEXT_BIAS = "text:"


@dataclass(frozen=True)
class Knob:
    """One request field. `kind` is float, int, bool or str for the fields the schema
    builds from this table; "seed", "logit_bias", "grammar", "json_schema", "strings" and
    "samplers" are declared by hand in app.schemas (their validation is their own)."""
    name: str
    kind: Any
    default: Any                # what a request that leaves it out gets
    doc: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False      # low itself is not allowed
    enum: tuple | None = None
    sampler: str | None = None  # the llama.cpp sampler it configures
    route: str | None = None    # routes by this worker capability (protocol.Route)
    alias: str | None = None    # another request name for it (llama.cpp's)

    @property
    def built(self) -> bool:
        """The schema builds its field from this declaration."""
        return self.kind in (float, int, bool, str)


SAMPLING: tuple[Knob, ...] = (
    Knob("temperature", float, 1.0, "0 is greedy.", 0.0, 2.0, sampler="temperature"),
    Knob("top_p", float, 1.0, "Nucleus sampling.", 0.0, 1.0, sampler="top_p"),
    Knob("top_k", int, 0, "Keep the k most likely tokens; 0 or -1: off.", -1, INT_MAX,
         sampler="top_k"),
    Knob("min_p", float, 0.0, "Drop tokens less likely than min_p × the most likely one; "
         "0: off.", 0.0, 1.0, sampler="min_p"),
    Knob("typical_p", float, 1.0, "Locally typical sampling; 1: off.", 0.0, 1.0,
         sampler="typ_p"),
    Knob("seed", "seed", None, "Same seed and parameters → same text."),
    Knob("presence_penalty", float, 0.0, "Penalty for tokens already generated at all "
         "(llama.cpp's routes: or in the prompt's last repeat_last_n tokens).",
         -2.0, 2.0, sampler="penalties"),
    Knob("frequency_penalty", float, 0.0, "Penalty growing with how often a token was "
         "generated.", -2.0, 2.0, sampler="penalties"),
    Knob("repetition_penalty", float, 1.0, "1: off.", 0.0, 10.0, low_open=True,
         sampler="penalties", alias="repeat_penalty"),
    Knob("repeat_last_n", int, -1, "Tokens the penalties look back over; -1: all "
         "generated (llama.cpp's routes: the prompt's too, as llama-server).", -1, INT_MAX,
         sampler="penalties"),
    Knob("mirostat", int, 0, "0 off, 1 Mirostat, 2 Mirostat 2.0.", enum=(0, 1, 2)),
    Knob("mirostat_tau", float, 5.0, "Mirostat target entropy.", 0.0, 100.0, low_open=True),
    Knob("mirostat_eta", float, 0.1, "Mirostat learning rate.", 0.0, 1.0, low_open=True),
    Knob("logit_bias", "logit_bias", None, "Token id → bias (-100..100; -100 bans); "
         "llama.cpp's [[id, bias]] form too (a string there is a text, digits too), bias "
         "false bans."),
    Knob("grammar", "grammar", None, "GBNF grammar (root rule `root`) the output must "
         "follow."),
    Knob("json_schema", "json_schema", None, "JSON schema the output must validate "
         "against."),
    Knob("min_tokens", int, 0, "No end of sequence before this many tokens.", 0, INT_MAX),
    Knob("ignore_eos", bool, False, "Never end at end of sequence."),
    Knob("dry_multiplier", float, 0.0, "DRY (don't repeat yourself) strength; 0: off.",
         0.0, 100.0, sampler="dry"),
    Knob("dry_base", float, 1.75, "DRY penalty base.", 1.0, 10.0, sampler="dry"),
    Knob("dry_allowed_length", int, 2, "Repeats up to this long go unpenalized.", 0,
         INT_MAX, sampler="dry"),
    Knob("dry_penalty_last_n", int, -1, "Tokens DRY looks back over; -1: the context, "
         "0: off.", -1, INT_MAX, sampler="dry"),
    Knob("dry_sequence_breakers", "strings", DRY_BREAKERS, "Strings that end a repeated sequence "
         "for DRY (default \\n, :, \", *).", sampler="dry"),
    Knob("xtc_probability", float, 0.0, "XTC (exclude top choices) chance; 0: off.", 0.0,
         1.0, sampler="xtc"),
    Knob("xtc_threshold", float, 0.1, "XTC removes choices above this probability "
         "(> 0.5: off).", 0.0, 1.0, sampler="xtc"),
    Knob("top_n_sigma", float, -1.0, "Keep tokens within n standard deviations of the "
         "best logit; -1: off.", -1.0, 100.0, sampler="top_n_sigma"),
    Knob("dynatemp_range", float, 0.0, "Dynamic temperature: temperature ± this, by "
         "entropy; 0: off.", 0.0, 2.0, sampler="temperature"),
    Knob("dynatemp_exponent", float, 1.0, "Dynamic temperature exponent.", 0.0, 10.0,
         low_open=True, sampler="temperature"),
    Knob("samplers", "samplers", None, "llama.cpp's sampler order (" + ", ".join(
        SAMPLER_NAMES) + "); samplers not listed are not applied."),
)

# geniex's routing fields: the request's name, and the capability it is matched against
ROUTING: tuple[Knob, ...] = (
    Knob("nctx", int, None, "This request's context length; goes to a worker with at "
         "least this context.", 1, INT_MAX, route="n_ctx"),
    Knob("ngl", int, None, "0: a worker without offload; N: one with at least N layers "
         "offloaded.", 0, INT_MAX, route="n_gpu_layers"),
    Knob("compute", str, None, "Workers of this kind only.", enum=COMPUTE_KINDS,
         route="compute"),
)

SAMPLING_NAMES = tuple(knob.name for knob in SAMPLING)
ROUTE = {knob.name: knob.route for knob in ROUTING}
DEFAULTS = {knob.name: knob.default for knob in SAMPLING}


def sampling_of(req: dict) -> dict:
    """A validated request's sampling fields, as a job carries them (None: the default)."""
    return {name: req.get(name) for name in SAMPLING_NAMES}


KNOBS = {knob.name: knob for knob in SAMPLING + ROUTING}
