"""URL lists read row by row: bad rows and duplicate URLs are skipped with their line numbers, in every
format."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from toolkit.data.acquire.urllist import check_url_list
from toolkit.data.acquire.urlrows import read_rows


def test_jsonl_txt_and_gzip_rows(tmp_path):
    jsonl = tmp_path / "list.jsonl"
    jsonl.write_text(
        '{"url": "http://h/a.jpg", "caption": "a"}\n'
        '{"url": "http://h/b.jpg", "caption": "b"\n'  # line 2: cut short
        "\n"
        '["http://h/c.jpg"]\n'  # line 4: not an object
        '{"url": 7, "caption": "seven"}\n'  # line 5: not a string
        '{"url": "http://h/a.jpg", "caption": "again"}\n'
    )  # line 6: duplicate
    rows = read_rows(str(jsonl), "jsonl", "url", "caption")
    assert rows.table.to_pylist() == [{"url": "http://h/a.jpg", "caption": "a"}]
    assert (rows.num_rows, dict(rows.counts)) == (5, {"malformed_row": 3, "duplicate_url": 1})
    assert [x.split(":", 1)[0] for x in rows.listed["malformed_row"]] == [
        f"{jsonl} line {n}" for n in (2, 4, 5)
    ]
    txt = tmp_path / "list.txt.gz"
    txt.write_bytes(gzip.compress(b'http://h/a,b.jpg\n\n"quoted"\nhttp://h/\xff.jpg\nhttp://h/a,b.jpg\n'))
    rows = read_rows(str(txt), "txt.gz", "url", None)
    assert rows.table.to_pylist() == [{"url": "http://h/a,b.jpg"}, {"url": '"quoted"'}]  # a line is a URL
    assert rows.listed == {
        "malformed_row": [f"{txt} line 4: not UTF-8"],
        "duplicate_url": [f"{txt} line 5: same URL as {txt} line 1: http://h/a,b.jpg"],
    }
    kept = read_rows(str(txt), "txt.gz", "url", None, keep_duplicates=True)
    assert kept.table.num_rows == 3 and dict(kept.counts) == {"malformed_row": 1}


def test_folder_of_parquets_and_tsvs_duplicates_across_files_by_row(tmp_path):
    folder = tmp_path / "lists"
    folder.mkdir()
    pq.write_table(pa.table({"u": ["http://h/1", "http://h/2"], "t": ["one", "two"]}), folder / "a.parquet")
    pq.write_table(pa.table({"u": ["http://h/3", "http://h/1"], "t": ["three", None]}), folder / "b.parquet")
    rows = read_rows(str(folder), "parquet", "u", "t")
    assert [r["url"] for r in rows.table.to_pylist()] == ["http://h/1", "http://h/2", "http://h/3"]
    assert rows.listed == {
        "duplicate_url": [f"{folder}/b.parquet row 2: same URL as {folder}/a.parquet row 1: http://h/1"]
    }
    tsv = tmp_path / "list.tsv"
    tsv.write_bytes(b"\xef\xbb\xbfurl\tcaption\nhttp://h/1\tone\tand more\nhttp://h/2\ttwo\n")
    assert check_url_list(str(tsv), "tsv", "url", "caption") == "caption"  # a BOM is not part of 'url'
    rows = read_rows(str(tsv), "tsv", "url", "caption")
    assert rows.table.to_pylist() == [{"url": "http://h/2", "caption": "two"}]
    assert rows.listed["malformed_row"] == [f"{tsv} line 2: 3 field(s), the header has 2"]


def test_unreadable_whole_files_name_the_file(tmp_path):
    bad = tmp_path / "list.json"
    bad.write_text('[{"url": "http://h/1"}, ')
    with pytest.raises(ValueError, match=r"list\.json: unreadable json URL list"):
        read_rows(str(bad), "json", "url", None)
    good = tmp_path / "ok.json"
    good.write_text(
        json.dumps([{"url": "http://h/1", "caption": "c"}, {"url": "http://h/1", "caption": "d"}])
    )
    rows = read_rows(str(good), "json", "url", "caption")
    assert rows.table.num_rows == 1 and rows.listed["duplicate_url"][0].startswith(
        f"{good} row 2: same URL as"
    )
    broken = tmp_path / "list.csv.gz"
    broken.write_bytes(gzip.compress(b"url,caption\nhttp://h/1,a\n")[:-12])
    with pytest.raises(ValueError, match=r"list\.csv\.gz: unreadable csv\.gz URL list"):
        read_rows(str(broken), "csv.gz", "url", "caption")


def test_folder_entries_that_are_not_read_are_named(tmp_path, caplog):
    """A folder list reads only *.{format}: a gzipped part beside plain ones, a subfolder of parts or any
    other file was left out without a word (its URLs never fetched, the totals silently smaller)."""
    folder = tmp_path / "lists"
    (folder / "more").mkdir(parents=True)
    (folder / "part-0.csv").write_text("url,caption\nhttp://h/a.jpg,a\n")
    (folder / "part-1.csv.gz").write_bytes(gzip.compress(b"url,caption\nhttp://h/b.jpg,b\n"))
    (folder / "more" / "part-2.csv").write_text("url,caption\nhttp://h/c.jpg,c\n")
    (folder / ".DS_Store").write_bytes(b"\0")
    with caplog.at_level("WARNING"):
        assert check_url_list(str(folder), "csv", "url", "caption") == "caption"
    assert f"{folder}: 2 entries in the folder are not *.csv and not read: more, part-1.csv.gz" in caplog.text
    assert read_rows(str(folder), "csv", "url", "caption").table.to_pylist() == [
        {"url": "http://h/a.jpg", "caption": "a"}
    ]


def test_tsv_is_one_row_a_line_with_literal_quotes(tmp_path):
    """A TSV caption that starts with a quote ('"Casablanca" poster', common in web alt texts) was a malformed
    row ("bad quoting"), and an unterminated one swallowed the lines after it; TSV has no quoting. Lines
    written with csv quoting (pandas, spreadsheets) are still unquoted."""
    tsv = tmp_path / "list.tsv"
    tsv.write_text(
        "url\tcaption\r\n"
        'http://h/1.jpg\t"Casablanca" poster\r\n'
        'http://h/2.jpg\t"unterminated caption\r\n'
        'http://h/3.jpg\tplain, 5" screen\r\n'
        'http://h/4.jpg\t"pandas ""quoted"" caption"\r\n'
        'http://h/5.jpg\t"a tab\tinside quotes"\r\n'
        "http://h/6.jpg\tone\ttoo many\r\n"
    )
    rows = read_rows(str(tsv), "tsv", "url", "caption")
    assert [r["caption"] for r in rows.table.to_pylist()] == [
        '"Casablanca" poster',
        '"unterminated caption',
        'plain, 5" screen',
        'pandas "quoted" caption',
        "a tab\tinside quotes",
    ]
    assert (rows.num_rows, rows.listed["malformed_row"]) == (
        6,
        [f"{tsv} line 7: 3 field(s), the header has 2"],
    )


@pytest.mark.parametrize(
    "data, message",
    [
        (
            "url\tcaption\r\nhttp://h/1.jpg\tchat\r\n".encode("utf-16"),
            r"u16.tsv: the file is UTF-16 text .* save it "
            r"as 'CSV UTF-8'",
        ),
        (b"url\rcaption\rhttp://h/1.jpg\rchat\r", r"u16.tsv: unreadable header line: new-line character"),
    ],
)
def test_utf16_and_carriage_return_lists_are_named_not_a_traceback(tmp_path, data, message):
    """A spreadsheet's 'Unicode text' export (UTF-16 TSV) or a list with old-Mac line ends crashed fetch with
    a bare `_csv.Error: new-line character seen in unquoted field` traceback naming no file."""
    (tmp_path / "u16.tsv").write_bytes(data)
    with pytest.raises(ValueError, match=message):
        check_url_list(str(tmp_path / "u16.tsv"), "tsv", "url", "caption")


def test_tsv_caption_quoted_over_several_lines_is_one_row(tmp_path):
    """pandas' to_csv(sep="\\t") quotes a caption that holds a newline and writes it over two lines; the csv
    reader read that as one row, and reading TSV line by line must too. A quote left open over more lines
    than any join parses (a caption that merely starts with a quote) stays literal, and the lines after it
    are rows of their own."""
    import pandas as pd

    tsv = tmp_path / "list.tsv"
    pd.DataFrame(
        {
            "url": ["http://h/1.jpg", "http://h/2.jpg", "http://h/3.jpg"],
            "caption": ["first line\nsecond line", 'a "quoted"\nword', "plain"],
        }
    ).to_csv(tsv, sep="\t", index=False)
    with open(tsv, "a") as fh:
        fh.write('http://h/4.jpg\t"never closed\nhttp://h/5.jpg\tafter it\n')
    rows = read_rows(str(tsv), "tsv", "url", "caption")
    assert [(r["url"][-5:], r["caption"]) for r in rows.table.to_pylist()] == [
        ("1.jpg", "first line\nsecond line"),
        ("2.jpg", 'a "quoted"\nword'),
        ("3.jpg", "plain"),
        ("4.jpg", '"never closed'),
        ("5.jpg", "after it"),
    ]
    assert rows.num_rows == 5 and not rows.listed.get("malformed_row")
