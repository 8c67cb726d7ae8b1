"""A raw sample's caption, as precompute keeps it and inspect counts it: ``caption_of`` (the ``--caption-ext``
member, plain text or a JSON object's field, stripped; or the skip reason and message), the check of a
``--caption-ext`` value, and the hint a skipped sample's members give."""

from __future__ import annotations

from toolkit.data.raw.reader import RawSample


def caption_of(sample: RawSample, ext: str) -> tuple[str | None, tuple[str, str] | None]:
    """(caption, None) or (None, (reason, message)) for the sample's caption member.

    ``ext`` names the member: ``txt`` (its text), or ``json`` / ``json:FIELD``: the string ``FIELD``
    (default ``caption``, where img2dataset writes it) of the member's JSON object, never the JSON text
    itself.
    """
    member, _, key = ext.partition(":")
    if member == "json" and not key:
        key = "caption"
    if member not in sample.files:
        return None, ("missing_caption", f"no .{member} member{_caption_hint(sample, member)}")
    try:
        text = sample.files[member].decode(
            "utf-8-sig"
        )  # a byte-order mark (Windows editors) is no caption text
    except UnicodeDecodeError as err:
        return None, ("non_utf8_caption", f"caption is not UTF-8: {err}")
    if key:
        text, problem = _json_caption(text, member, key)
        if problem is not None:
            return None, problem
    text = text.strip()
    if not any(
        ch.isprintable() and not ch.isspace() for ch in text
    ):  # NULs, controls: the tokenizer drops them
        return None, (
            "empty_caption",
            "caption is empty or whitespace only"
            if not text
            else f"caption has no printable character ({text[:20]!r})",
        )
    return text, None


def check_caption_ext(value: str) -> None:
    """ValueError naming the key unless ``value`` is a member extension as the reader keys them (lower case,
    no leading dot: ``txt``, ``caption.txt``) or ``json:FIELD``; '.txt' or 'TXT' matched no member at all."""
    import re

    member, colon, key = value.partition(":")
    if not re.fullmatch(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*", member) or (colon and (member != "json" or not key)):
        raise ValueError(
            f"caption_ext: {value!r} is not a caption member: give its extension in lower case without "
            "the dot (txt, json, json:FIELD; members' extensions are read in lower case)"
        )


def _json_caption(text: str, member: str, key: str) -> tuple[str, tuple[str, str] | None]:
    """The string ``key`` of the JSON object in ``text`` (a ``.member`` member), or a skip (reason,
    message)."""
    import json

    try:
        obj = json.loads(text)
    except ValueError as err:
        return "", ("bad_caption_json", f".{member} member is not valid JSON: {err}")
    value = obj.get(key) if isinstance(obj, dict) else None
    if value is None:
        return "", ("missing_caption", f"the .{member} member has no {key!r} key")
    if not isinstance(value, str):
        return "", (
            "bad_caption_json",
            f"{key!r} of the .{member} member is a {type(value).__name__}, not a string",
        )
    return value, None


def _caption_hint(sample: RawSample, member: str) -> str:
    """Why a caption member is missing, when the sample shows it: its .json holds a caption (img2dataset
    writes it there too; some webdatasets carry it only there), or its files were grouped under a dotted
    key."""
    if member != "json" and b'"caption"' in sample.files.get("json", b""):
        return " (its .json member has a 'caption': --caption-ext json reads it)"
    return members_hint(sample)


def members_hint(sample: RawSample) -> str:
    """' (members: ...)' of a skipped sample; for files named ``name.part.ext`` it adds webdataset's rule that
    put them all under the key ``name``, which is why no member is called ``.txt`` or ``.jpg``."""
    names = sorted(sample.files)
    listed = ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
    if any("." in ext for ext in names):
        return (
            f" (members: {listed}; a key ends at the first dot of the file name, so files named "
            f"{sample.key}.<part>.<ext> form one sample {sample.key!r}: rename them without dots in the key)"
        )
    return f" (members: {listed})"
