"""difftune's own built-in validation prompts (`validation_prompt_library: true`).

A small, varied set: each probes something a fine-tune can break (faces, wide scenes, lettering, fur,
fine texture, straight lines). Names are used in the sample file names, like a user library's.
Import-light: the config schema reads it.
"""

from __future__ import annotations

BUILTIN_PROMPTS: dict[str, str] = {
    "portrait": "a close-up portrait of an elderly fisherman with a weathered face and a grey beard, soft window "
                "light, shallow depth of field",
    "landscape": "a wide mountain valley at sunrise, mist over a winding river, pine forests on the slopes, snow "
                 "on the far peaks",
    "lettering": "a hand-painted wooden shop sign that reads \"OPEN ALL NIGHT\" in bold red letters, on a brick "
                 "wall",
    "animal": "a red fox sitting in fresh snow, its thick winter fur catching the afternoon sun, looking at the "
              "camera",
    "closeup": "a macro photograph of a vintage pocket watch with an engraved brass case and visible gears, on "
               "dark velvet",
    "architecture": "a modern concrete library with tall glass windows and a cantilevered roof, symmetrical "
                    "front view at dusk",
    "still-life": "a still life of lemons, a blue ceramic jug and a folded linen cloth on a rustic kitchen table, "
                  "oil painting",
    "street": "a busy night market street in the rain, neon signs reflected in puddles, people with umbrellas",
}
