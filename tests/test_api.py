"""The public surface: `tfdp_variants.__all__` is the list docs/api.md documents, and each name
in it exists."""

import pathlib
import re

import tfdp_variants

API = pathlib.Path(__file__).resolve().parents[1] / "docs" / "api.md"


def test_all_is_the_documented_list():
  table = [line.split("|")[1] for line in API.read_text().splitlines()
           if line.startswith("| `")]
  documented = [name for cell in table for name in re.findall(r"`([A-Za-z_]+)`", cell)]
  assert sorted(documented) == sorted(tfdp_variants.__all__)
  assert len(set(documented)) == len(documented)


def test_every_name_exists_and_the_seams_are_left_out():
  assert all(hasattr(tfdp_variants, name) for name in tfdp_variants.__all__)
  assert not {"stack", "validation", "private_step", "per_example"} & set(tfdp_variants.__all__)
