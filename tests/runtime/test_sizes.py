import pytest

from runtime.sizes import parse_size


@pytest.mark.parametrize(
    "text,size",
    [("5GB", 5 * 10**9), ("512MiB", 512 * 2**20), (" 4096 ", 4096), ("1.5kb", 1500), ("2TiB", 2 * 2**40)],
)
def test_sizes_in_si_and_binary_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["lots", "5 GBs", "-1GB", "", "9" * 100_000])
def test_anything_else_is_refused_quoting_a_bounded_text(text):
    with pytest.raises(ValueError) as e:
        parse_size(text)
    assert len(str(e.value)) < 200
