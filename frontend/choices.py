"""How `select` picks a choice: the method objects of `sglang.lang.choices`, by the same names.

k3rt scores choices on the server (backend/program/executor.py `_select`), so a method here is a name the
server knows, not code that runs on the client. The three methods, given each choice's token logprobs
(the tokens that differ from the prefix's own, a healed boundary token included):

  token_length_normalized (default)   the highest mean token logprob.
  greedy_token_selection              compare token by token; the choices with the best logprob at
                                      position j go on to j + 1. A choice that ran out of tokens
                                      continues with its own mean logprob. Ties: the first choice.
  unconditional_likelihood_normalized the highest mean of (logprob in context - logprob of the same
                                      token ids scored alone); alone, the first token has no context
                                      and counts 0 (SGLang's rule), so one-token choices score as in
                                      token_length_normalized.

A user-defined subclass cannot run on the server: `select` refuses it rather than ignore it.
"""

from __future__ import annotations


class ChoicesSamplingMethod:
    """A select method. `name` is what the program ships (frontend/ir.py CHOICE_METHODS)."""

    name = ""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return self.name == "unconditional_likelihood_normalized"

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TokenLengthNormalized(ChoicesSamplingMethod):
    name = "token_length_normalized"


class GreedyTokenSelection(ChoicesSamplingMethod):
    name = "greedy"


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    name = "unconditional_likelihood_normalized"


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()

_BUILTIN = (TokenLengthNormalized, GreedyTokenSelection, UnconditionalLikelihoodNormalized)


def method_name(method: ChoicesSamplingMethod | str) -> str:
    """The shipped name of a method object (or of a name, k3rt's older spelling)."""
    if isinstance(method, str):
        return method
    if type(method) in _BUILTIN:
        return method.name
    raise TypeError(f"choices_method: {method!r} is not one of k3rt's methods (token_length_normalized, "
                    "greedy_token_selection, unconditional_likelihood_normalized); k3rt scores choices on the "
                    "server, so a user-defined ChoicesSamplingMethod cannot run")
