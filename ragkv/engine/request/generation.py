"""Decoding options of one request (sampling, stops, penalties, log-probabilities): below the fusion modes, so the
decode loop (engine/decode/generate.py) depends on no mode."""

from __future__ import annotations

from dataclasses import dataclass

from ragkv.engine.request.option_spec import check_option, option, option_specs
from ragkv.errors import OptionError


@dataclass(frozen=True)
class GenerationOptions:
    max_new_tokens: int = option(128, "tokens to generate at most", ge=0)
    temperature: float = option(0.0, "sampling temperature; 0: greedy", ge=0)
    top_p: float = option(1.0, "nucleus sampling: keep the smallest set of tokens with this probability", gt=0, le=1)
    seed: int | None = option(None, "sampling seed (None: a fresh one)")
    stop: tuple[str, ...] = option((), "strings that end the answer (not included)")
    min_tokens: int = option(0, "tokens to generate before an end-of-sequence token or a stop string may end the "
                             "answer (vLLM's; a fixed-length answer for benchmarks)", ge=0)
    top_k: int = option(0, "keep the k most likely tokens; <= 0: off")
    min_p: float = option(0.0, "drop tokens below min_p times the most likely one's probability; 0: off", ge=0, le=1)
    presence_penalty: float = option(0.0, "OpenAI's, on generated tokens")
    frequency_penalty: float = option(0.0, "OpenAI's, on generated tokens")
    repetition_penalty: float = option(1.0, "CTRL's, on prompt and generated tokens; 1: off", gt=0)
    logprobs: int | None = option(None, "None: none; k: each chosen token's log-probability and the k most likely",
                                  ge=0)
    # constrained decoding: llguidance's grammar (engine/decode/constrained.py json_grammar), or None: free text
    grammar: str | None = option(None, "a grammar every answer follows (engine/decode/constrained.py)")

    def __post_init__(self):
        for spec in option_specs(GenerationOptions):
            check_option(spec, getattr(self, spec.name))
        if self.min_tokens > self.max_new_tokens:
            raise OptionError("min_tokens", f"min_tokens ({self.min_tokens}) cannot exceed the answer's limit, "
                              f"max_new_tokens / max_tokens ({self.max_new_tokens})")

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
