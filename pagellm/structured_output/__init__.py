"""Structured output (guided decoding) with xgrammar: JSON schemas, any JSON object, regexes, choices
and EBNF/Lark grammars.

Why it is built this way:
- Valid by construction: every logits row of a constrained sequence is masked to the tokens its grammar
  allows before any other processing (penalties, top-k, greedy argmax), so whatever the sampler picks,
  and every accepted speculative draft, keeps the output a prefix of a valid one; the grammar allows the
  end-of-sequence token only once it is complete, so "stop" means a complete output and "length" a cut one.
- Compile once, off the engine loop: specs are compiled and cached by their canonical text (the server
  compiles in a worker thread before admission, where an invalid spec becomes a 400; the engine's own
  add_request compiles too and then hits the cache). JSON-schema keywords xgrammar would silently ignore
  are refused by name (schema_check.py) rather than producing output that does not validate.
- The matcher follows the tokens, never the other way round: a GrammarState (request_state.py) accepts
  whatever output tokens it has not seen when its next mask is needed. Recompute preemption, accepted
  drafts and beam forks therefore need no bookkeeping, and nothing is accepted twice.
- Nothing is paid without a grammar: the manager imports xgrammar on first use, and a step whose batch
  has no constrained sequence only loops over its requests.
This package imports no model, engine or server code, so the sampler may use it.
"""

from pagellm.structured_output.manager import StructuredOutputManager, tokenizer_info
from pagellm.structured_output.request_state import GrammarError, GrammarState, apply_grammar_masks, trim_drafts

__all__ = ["GrammarError", "GrammarState", "StructuredOutputManager", "apply_grammar_masks", "tokenizer_info",
           "trim_drafts"]
