"""Per-request sampling parameters, shaped like vLLM's so users can switch engines.

The struct travels inside EngineCoreRequest frames, hence a msgspec Struct with array_like and
omit_defaults: a request that keeps the defaults costs a few bytes on the wire.
"""

from __future__ import annotations

import math

import msgspec

_MIN_TEMPERATURE = 0.01  # vLLM's floor of a temperature above 0

# Every stop string is searched for after every output token, and every stop token id is looked
# up in the engine each step: unbounded lists let one request slow every other one's stream.
# OpenAI takes 4 stop strings; these bounds leave room for vLLM-style clients.
MAX_STOP_STRINGS = 128
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries; OpenAI's values are in [-100, 100]
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # above any vocabulary this engine loads
MAX_BAD_WORDS = 128
# The lists' caps, by field name: the server counts them in a large body before validating it.
LIST_CAPS = {
    "stop": MAX_STOP_STRINGS,
    "stop_token_ids": MAX_STOP_TOKEN_IDS,
    "allowed_token_ids": MAX_ALLOWED_TOKEN_IDS,
    "bad_words": MAX_BAD_WORDS,
    "logit_bias": MAX_LOGIT_BIAS,
}
# A grammar is compiled in the engine (engine/structured_output.py); its size bounds that work.
MAX_GRAMMAR_CHARS = 1 << 20
MAX_CHOICES = 4096


class StructuredOutputsParams(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """Constrain the output to a JSON schema, a regex, one of some strings or a grammar (vLLM's
    ``structured_outputs``). Exactly one of the constraints is given. The engine compiles it
    (llguidance) and masks every step's logits to the tokens the constraint allows; the request
    stops once the output is complete (nothing more could follow).
    """

    json: str | dict | None = None  # a JSON schema (object or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance's syntax) or GBNF (lines of ``a ::= b``)
    json_object: bool = False  # any JSON object
    # vLLM's: JSON without whitespace between tokens (small models can loop on newlines)
    disable_any_whitespace: bool = False

    def validate(self) -> None:
        if type(self.json_object) is not bool or type(self.disable_any_whitespace) is not bool:
            raise ValueError("json_object and disable_any_whitespace must be true or false")
        if self.choice is not None and not isinstance(self.choice, list):
            raise ValueError("choice must be a list of strings")
        if not isinstance(self.json, str | dict | None):
            raise ValueError("json must be a JSON schema: an object or its text")
        given = [
            name
            for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, regex, choice, grammar and "
                f"json_object, got {given or 'none'}"
            )
        if self.choice is not None:
            if not self.choice or len(self.choice) > MAX_CHOICES:
                raise ValueError(f"choice takes 1 to {MAX_CHOICES} strings")
            if any(type(c) is not str or not c for c in self.choice):
                raise ValueError("choice must be a list of non-empty strings")
        size = sum(len(c) for c in self.choice or ())
        for text in (self.regex, self.grammar, self.json if isinstance(self.json, str) else None):
            if text is not None and type(text) is not str:
                raise ValueError("regex and grammar must be strings")
            size += len(text or "")
        if size > MAX_GRAMMAR_CHARS:
            raise ValueError(
                f"a structured output constraint takes at most {MAX_GRAMMAR_CHARS} characters"
            )


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return besides the sampled one
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Logprobs of the prompt's tokens (vLLM): each one's own and the top-n of its position.
    # Such a request computes its whole prompt (no prefix-cache hit: a cached position has no
    # logits).
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # OpenAI's: added to these tokens' logits before sampling (-100 bans a token, 100 all but
    # forces it); logprobs stay the model's (vLLM's raw logprobs)
    logit_bias: dict[int, float] | None = None
    # vLLM's: only these tokens can be sampled
    allowed_token_ids: list[int] | None = None
    # vLLM's: words not generated as the model tokenizes them (with and without a leading
    # space); a word's last token is refused where the output so far ends with its others
    bad_words: list[str] = []

    def __post_init__(self) -> None:
        # What vLLM's SamplingParams accepts and normalises, so configs written for it work.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.bad_words is None:
            self.bad_words = []
        if self.logit_bias and any(type(k) is str for k in self.logit_bias):
            try:  # vLLM's: JSON keys are strings
                self.logit_bias = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise ValueError("logit_bias keys must be token ids") from None
        if self.seed == -1:  # vLLM's "no seed"
            self.seed = None
        if 0.0 < self.temperature < _MIN_TEMPERATURE:
            # vLLM's: only 0 is greedy; a tiny temperature samples at the smallest it allows
            # (n > 1 at 1e-6 gives varied completions, as there)
            self.temperature = _MIN_TEMPERATURE
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def stop_holdback(self) -> int:
        """Characters a stream withholds until the request ends: a stop string completed later
        cuts the text back to where it starts, and what was already sent cannot be taken back."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field; the engine turns it into a client error.

        Values only (this runs on every decode, where msgspec has already checked the types);
        the frontend calls ``check_types`` first.
        """
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        # as vLLM: any positive finite repetition penalty, any int64 seed (-1: none)
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(
                f"repetition_penalty must be positive and finite, got {self.repetition_penalty}"
            )
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, "
                f"got {len(self.stop_token_ids)}"
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative")
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens")
            if any(t < 0 for t in self.logit_bias):
                raise ValueError("logit_bias keys must be token ids")
            if not all(
                isinstance(b, int | float) and -100.0 <= b <= 100.0
                for b in self.logit_bias.values()
            ):
                raise ValueError("logit_bias values must be in [-100, 100]")
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words takes at most {MAX_BAD_WORDS} words")
        if any(type(w) is not str or not w.strip() or len(w) > 1000 for w in self.bad_words):
            raise ValueError("bad_words must be non-blank words of at most 1000 characters")
        if self.allowed_token_ids is not None:
            if not 0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(f"allowed_token_ids takes 1 to {MAX_ALLOWED_TOKEN_IDS} ids")
            if any(t < 0 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be token ids")

    def check_types(self) -> None:
        """Raise ValueError for a field of the wrong type or beyond int64.

        Why: fields can be assigned after construction, and a value the wire format or the
        engine cannot take must fail in the frontend, not as an undecodable message in the engine.
        """
        for name in _INT_FIELDS:
            v = getattr(self, name)
            if v is None and name in _OPTIONAL:
                continue
            if type(v) is not int:
                raise ValueError(f"{name} must be an integer, got {v!r}")
            if not -_INT_LIMIT <= v < _INT_LIMIT:
                raise ValueError(f"{name} is out of range: {v}")
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if type(v) is int:
                setattr(self, name, float(v))
            elif type(v) is not float:
                raise ValueError(f"{name} must be a number, got {v!r}")
        for name in _BOOL_FIELDS:
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.stop, list) or any(type(x) is not str for x in self.stop):
            raise ValueError("stop must be a string or a list of strings")
        ids = self.stop_token_ids
        if not isinstance(ids, list) or any(
            type(t) is not int or not 0 <= t < _INT_LIMIT for t in ids
        ):
            raise ValueError("stop_token_ids must be a list of token ids")
        if not isinstance(self.bad_words, list) or any(type(w) is not str for w in self.bad_words):
            raise ValueError("bad_words must be a list of strings")
        bias = self.logit_bias
        if bias is not None and (
            not isinstance(bias, dict)
            or any(type(t) is not int or not 0 <= t < _INT_LIMIT for t in bias)
            or any(type(b) not in (int, float) for b in bias.values())
        ):
            raise ValueError("logit_bias must map token ids to numbers")
        if bias:
            self.logit_bias = {t: float(b) for t, b in bias.items()}
        allowed = self.allowed_token_ids
        if allowed is not None and (
            not isinstance(allowed, list)
            or any(type(t) is not int or not 0 <= t < _INT_LIMIT for t in allowed)
        ):
            raise ValueError("allowed_token_ids must be a list of token ids")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")


_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")
_OPTIONAL = ("seed", "max_tokens", "logprobs", "prompt_logprobs")
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")
_INT_LIMIT = 1 << 63  # what msgpack and the engine's int64 take


def checked_defaults(defaults: dict[str, float | int], source: object) -> dict[str, float | int]:
    """A model's request defaults (generation_config.json, GGUF general.sampling.*), refused
    at load, naming ``source``, when a request could not take them (not per request)."""
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    return defaults
