"""JSON-schema extraction: turn free-text bios into records that validate against a JSON schema. The schema
constrains decoding (keys, types, enums, bounds, lengths), so `json.loads` never fails and the record always
validates; what the model fills in is its own business (a random checkpoint fills in noise).

    python examples/json_extraction.py --model DIR [--in-process] [--json]
"""

from __future__ import annotations

import json
from typing import Any

from _common import backend, emit, parser

import k3rt

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "maxLength": 20},
        "languages": {"type": "array", "items": {"enum": ["English", "French", "German", "Spanish", "Italian"]},
                      "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "languages", "employed"],
    "additionalProperties": False,
}

BIOS = [
    "Marie, 34, lives in Lyon. She speaks French and English and works as a nurse.",
    "Klaus is a retired engineer from Hamburg, aged 71, who speaks German and a little Spanish.",
    "Lucia (19) studies in Milan; Italian is her first language, English her second. No job yet.",
]


@k3rt.function
def extract_person(s, bio):
    s += k3rt.system("Extract a JSON record with the fields name, age, city, languages and employed.")
    s += k3rt.user(bio)
    s += k3rt.assistant(k3rt.gen("record", json_schema=PERSON_SCHEMA, max_tokens=192))


def run(backend: Any, bios: list[str] = BIOS) -> list[dict[str, Any]]:
    states = extract_person.run_batch([{"bio": b} for b in bios], backend=backend, temperature=0)
    return [{"bio": b, "record": json.loads(st["record"]), "finish_reason": st.meta("record")["finish_reason"]}
            for b, st in zip(bios, states)]


def show(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        print(r["bio"])
        print("  " + json.dumps(r["record"], ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    with backend(args) as be:
        emit(args, run(be), show)


if __name__ == "__main__":
    main()
