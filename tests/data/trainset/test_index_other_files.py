"""An index set copied beside another raw folder with the same file names (issue 43 item 19): `data verify`
reported every sample "damaged: checksum does not match" without saying that the set now points at other
shards. The checksums the index recorded tell it: a data file none of whose samples match is another file."""

from __future__ import annotations

import shutil

import numpy as np
from datakit import good_samples, precompute, write_raw_shard

from toolkit.core.config import build
from toolkit.data.trainset import verify


def _verify(root):
    return verify.run(build(verify.VerifyConfig, {"input": str(root)}))


def test_an_index_beside_other_shards_of_the_same_names_says_so(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    for base, seed in ((first, 0), (second, 1)):
        (base / "raw").mkdir(parents=True)
        for shard in range(2):
            rng = np.random.default_rng(seed * 10 + shard)
            write_raw_shard(base / "raw" / f"0000{shard}.tar", good_samples(rng, f"s{shard}", 4))
    precompute(first / "raw", first / "index", storage="index", num_workers=1)
    assert _verify(first / "index").ok
    shutil.copytree(first / "index", second / "index")  # data_root ../raw: now the second folder's shards
    result = _verify(second / "index")
    assert result.num_damaged_samples == 8
    line = result.problems[0]
    assert line.startswith(
        f"{second / 'raw'}: 2 of the 2 data files (00000.tar, 00001.tar) match none of "
        "the checksums recorded for their samples: they are not the files this set "
        "indexed"
    ), line
    assert sum("not the files this set indexed" in p for p in result.problems) == 1


def test_one_damaged_sample_is_not_called_another_file(tmp_path):
    (tmp_path / "raw").mkdir()
    samples = good_samples(np.random.default_rng(3), "s", 4)
    write_raw_shard(tmp_path / "raw" / "00000.tar", samples)
    precompute(tmp_path / "raw", tmp_path / "index", storage="index", num_workers=1)
    tar = tmp_path / "raw" / "00000.tar"
    data = bytearray(tar.read_bytes())
    at = data.index(samples[1][1]["jpg"][200:216])  # a byte inside the second image
    data[at] ^= 0xFF
    tar.write_bytes(bytes(data))
    result = _verify(tmp_path / "index")
    assert result.num_damaged_samples == 1
    assert not any("not the files this set indexed" in p for p in result.problems), result.problems
