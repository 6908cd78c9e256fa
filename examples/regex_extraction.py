"""Regex-constrained extraction: pull fields out of a document, each generated under a regular expression,
so every value has the right shape whatever the model does (the grammar masks every other token). The whole
program, five constrained generations, ships to the server in one round trip.

Patterns use explicit classes ([0-9], not \\d): constraints follow Rust regex semantics, where \\d matches
any Unicode digit.

    python examples/regex_extraction.py --model DIR [--in-process] [--json]
"""

from __future__ import annotations

from typing import Any

from _common import backend, emit, parser

import k3rt

FIELDS = {
    "invoice_number": r"INV-[0-9]{4}",
    "date": r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "email": r"[a-z]{1,12}(\.[a-z]{1,12})?@[a-z]{1,12}\.(com|org|net)",
    "amount": r"[0-9]{1,5}\.[0-9]{2}",
    "currency": r"(EUR|USD|GBP)",
}

DOCUMENTS = [
    "Invoice INV-4821 was issued on 2024-03-17 to Ada Lovelace (ada@example.com) for 129.99 EUR.",
    "Billed 2023-11-02: invoice INV-0077, customer grace.hopper@navy.org, total 4500.00 USD.",
]


@k3rt.function
def extract(s, document):
    s += k3rt.system("You extract fields from documents. Copy each value exactly.")
    s += k3rt.user(f"Document: {document}\nExtract: {', '.join(FIELDS)}.")
    s += k3rt.assistant_begin()
    for name, pattern in FIELDS.items():
        s += f"{name}: " + k3rt.gen(name, regex=pattern, max_tokens=32) + "\n"
    s += k3rt.assistant_end()


def run(backend: Any, documents: list[str] = DOCUMENTS) -> list[dict[str, Any]]:
    out = []
    for doc in documents:
        state = extract.run(document=doc, backend=backend, temperature=0)
        out.append({"document": doc, "fields": {name: state[name] for name in FIELDS}})
    return out


def show(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        print(r["document"])
        for name, value in r["fields"].items():
            print(f"  {name:>15}: {value}")
        print()


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    with backend(args) as be:
        emit(args, run(be), show)


if __name__ == "__main__":
    main()
