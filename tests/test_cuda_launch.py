"""The CUDA plugin's launch tables, pinned: every choice over a grid straddling each bound the tables test.

EXPECTED holds, per function, the grid's axes (arguments in call order), the distinct configs, and one letter per
grid point (itertools order) naming its config. A table edit that changes a choice fails here; change the letters
only together with the measurement that justifies the new choice (docs/architecture.md).
"""

import itertools
import os
import string

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton.jit of the plugin

pytest.importorskip("triton", reason="triton is a test dependency (pip install triton)")

from flashnext.plugins.cuda import launch  # noqa: E402

EXPECTED = {
    "skinny_config": (
        (
            (1024, 4095, 4096, 6143, 6144, 32768, 32769),
            (96, 576, 1024, 2048, 3072, 9728, 12288),
            (1, 16, 17, 32, 33, 64),
            (1, 2),
        ),
        (
            (16, 32, 4, 1),
            (16, 64, 4, 1),
            (16, 256, 4, 1),
            (16, 512, 4, 1),
            (32, 256, 3, 4),
            (32, 128, 3, 4),
            (32, 32, 4, 1),
            (32, 64, 4, 1),
            (32, 128, 4, 1),
            (32, 256, 4, 1),
            (64, 32, 4, 1),
            (64, 64, 4, 1),
            (64, 256, 4, 1),
            (64, 128, 4, 1),
            (64, 32, 3, 1),
            (64, 64, 3, 1),
            (64, 256, 3, 1),
            (64, 128, 3, 1),
        ),
        (
            "aaaaaaaaaaaabbbbbbbbbbbbccccdcdcdcdcccccdcdcdcdceeeedcdcdcdccfcfdcdcdcdceeeedcdcdcdcaaaaaaaaaaaabbbb"
            "bbbbbbbbccccdcdcdcdcccccdcdcdcdceeeedcdcdcdccfcfdcdcdcdceeeedcdcdcdcgggggggggggghhhhhhhhhhhhiiiijiji"
            "jijiiiiijijijijieeeejijijijiififjijijijieeeejijijijigggggggggggghhhhhhhhhhhhiiiijijijijiiiiijijijiji"
            "eeeejijijijiififjijijijieeeejijijijiggggkkkkkkkkhhhhlllllllliiiimnmnmnmniiiimnmnmnmneeeemnmnmnmnifif"
            "mnmnmnmneeeemnmnmnmnggggkkkkkkkkhhhhlllllllliiiimnmnmnmniiiimnmnmnmneeeemnmnmnmnififmnmnmnmneeeemnmn"
            "mnmnooooooooooooppppppppppppqrqrqrqrrrrrqrqrqrqrrrrrqrqrqrqrrrrrqrqrqrqrrrrrqrqrqrqrrrrr"
        ),
    ),
    "int4_skinny_config": (
        ((96, 320, 576, 1024, 1536, 2048, 2560, 3072, 9728), (1, 16, 17, 32), (32, 64, 128, 256)),
        (
            (32, 32, 3, 1),
            None,
            (16, 32, 3, 1),
            (32, 64, 3, 1),
            (16, 64, 3, 1),
            (32, 256, 3, 1),
            (16, 256, 3, 1),
            (16, 256, 3, 2),
            (16, 256, 3, 4),
        ),
        (
            "abbbabbbcbbbcbbbddbbddbbeebbeebbddbbddbbeebbeebbffffffffgggggggghhhhhhhhhhhhhhhhhhhhhhhhiiiiiiiihhhh"
            "hhhhiiiiiiiihhhhhhhhiiiiiiiihhhhhhhhiiiiiiii"
        ),
    ),
    "int4_wide_config": (
        (
            (2048, 2560, 6144, 9728, 12288, 151936),
            (96, 576, 2048, 2560, 3072, 4096, 9728),
            (17, 32, 33, 64),
            (32, 64, 128),
        ),
        ((64, 32, 2, 2), None, (64, 64, 3, 2), (64, 256, 3, 2), (64, 64, 2, 2), (64, 256, 3, 1), (64, 128, 2, 2)),
        (
            "abbabbabbabbccbccbccbccbddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddabbabbabbabbeebe"
            "ebeebeebddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddabbabbabbabbeebeebeebeebddddddff"
            "ffffddddddffffffddddddffffffddddddffffffddddddddddddabbabbabbabbeebeebeebeebggggggggggggddddddffffff"
            "ddddddffffffddddddffffffddddddddddddabbabbabbabbeebeebeebeebggggggggggggggggggggggggggggggggggggdddd"
            "ddffffffddddddffffffabbabbabbabbeebeebeebeebgggggggggggggggggggggggggggggggggggggggggggggggggggggggg"
            "gggg"
        ),
    ),
    "int4_int8_config": (
        (
            (1024, 2048, 2560, 4096, 6144, 12288, 19456),
            (96, 576, 2048, 2560, 3072, 4096, 9728, 12288),
            (1, 16, 17, 32),
            (32, 64, 128),
        ),
        (
            (32, 32, 4, 1),
            (32, 64, 4, 1),
            (32, 128, 4, 1),
            (64, 32, 3, 2),
            (64, 64, 3, 2),
            (64, 128, 3, 2),
            (32, 64, 3, 2),
            (32, 128, 3, 2),
            (32, 512, 3, 2),
            (64, 256, 3, 2),
            (32, 256, 3, 2),
            (32, 512, 3, 1),
            (32, 256, 3, 1),
            (64, 128, 3, 1),
        ),
        (
            "abcabcdefdefgghggheefeefiiiiiijjjjjjkkkkkkjjjjjjiiiiiijjjjjjiiiiiijjjjjjkkkkkkjjjjjjiiiiiijjjjjjabca"
            "bcdefdefgghggheefeeflllllljjjjjjmmmmmmjjjjjjlllllljjjjjjiiiiiijjjjjjkkkkkkjjjjjjiiiiiijjjjjjabcabcde"
            "fdefbbcbbceefeefkkkkkkjjjjjjmmmmmmjjjjjjlllllljjjjjjlllllljjjjjjkkkkkkjjjjjjiiiiiijjjjjjabcabcdefdef"
            "bbcbbceefeefkkkkkkjjjjjjkkkkkkjjjjjjkkkkkkjjjjjjlllllljjjjjjkkkkkkjjjjjjiiiiiijjjjjjabcabcdefdefbbcb"
            "bceefeefkkkkkkjjjjjjkkkkkkjjjjjjkkkkkkjjjjjjkkkkkkjjjjjjmmmmmmjjjjjjiiiiiijjjjjjabcabcdefdefbbcbbcee"
            "feefccccccjjjjjjccccccjjjjjjccccccjjjjjjkkkkkkjjjjjjkkkkkkjjjjjjlllllljjjjjjabcabcdefdefbbcbbceefeef"
            "ccccccjjjjjjccccccjjjjjjccccccjjjjjjnnnnnnjjjjjjkkkkkkjjjjjjkkkkkkjjjjjj"
        ),
    ),
    "paged_config": (
        ((32, 64, 128, 256), (False, True), (False, True)),
        ((64, 4, 3), (64, 2, 3), (64, 2, 4), (32, 4, 3)),
        ("abacabacabacdddd"),
    ),
    "e5m2_decode_config": (
        ((32, 64, 128, 256),),
        ((128, 4, 2), (64, 4, 2)),
        ("aaab"),
    ),
    "skinny_block_m": (
        ((1, 2, 5, 16, 17, 24, 32, 33, 64, 65, 128), (0, 1, 2)),
        (16, 64, 32, 128),
        ("aaaaaaaaaaaabbcbbcbbcbbbbbbdddddd"),
    ),
    "gemv_config": (
        ((64, 576, 1024, 2048, 3640, 3641, 4096, 151936), (64, 576, 1024, 2048, 4096, 4097, 9728, 16384), (0, 1, 2)),
        ((8, 4), (4, 4), (16, 4), (2, 4), (16, 8)),
        (
            "abcabcabcabcabcddcddcddcabcabcabcabcbbeddcddcddcabcabcabcbbebbeddcddcddcabcabcbbebbebbeddcddcddcabca"
            "bcbbebbebbeddcddcddcabcbbebbebbebbeddcddcddcabcbbebbebbebbeddcddcddcbbebbebbebbebbeddcddcddc"
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_launch_table_matches_the_recorded_choices(name):
    axes, configs, codes = EXPECTED[name]
    fn = getattr(launch, name)
    grid = list(itertools.product(*axes))
    assert len(grid) == len(codes)
    wrong = [(args, fn(*args), configs[string.ascii_letters.index(c)]) for args, c in zip(grid, codes)]
    wrong = [w for w in wrong if w[1] != w[2]]
    assert not wrong, f"{name}: (args, now, recorded) {wrong[:5]}"
