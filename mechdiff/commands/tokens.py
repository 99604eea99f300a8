"""``mechdiff tokens TEXT --model M``: how a model's tokenizer splits a string, offline (no weights load): each
token's index, id, text and character span, as a task's records hold them
(`mechdiff.models.tokenization.tokens`)."""

from __future__ import annotations

import argparse
import json

from ..models.tokenization import offline_tokenizer, tokens, tokens_table


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tokens",
        help="show how a model's tokenizer splits TEXT (ids, pieces, character spans); loads no weights",
    )
    p.add_argument("text", nargs="+", help="the text (several arguments are compared, one table each)")
    p.add_argument("--model", required=True, help="a registry name (`mechdiff models`), a path or a hub id")
    p.add_argument("--json", action="store_true", help="one JSON list of tokens per text, one a line")
    p.add_argument("--cache-dir", default=None, help="Hugging Face cache directory for hub ids")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    tokenizer = offline_tokenizer(args.model, args.cache_dir)
    for i, text in enumerate(args.text):
        toks = tokens(text, tokenizer=tokenizer)
        if args.json:
            print(json.dumps([t.__dict__ for t in toks]))
            continue
        print(("\n" if i else "") + f"{text!r}: {len(toks)} tokens ({args.model})")
        print(tokens_table(toks))
    return 0
