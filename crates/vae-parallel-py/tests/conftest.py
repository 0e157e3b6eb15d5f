"""What every test of the package shares: the cost model's built-in constants.

Without a calibrated profile, `auto` probes the CPU on its first use (seconds) and caches the
result under the user's config directory; the tests predict with the built-in constants instead,
deterministic and fast, and write nothing there (the CLI they start inherits the setting).
"""

import os

os.environ["VAE_COST_PROBE"] = "0"
