"""The layout of the request header rank 0 sends every other rank, without torch: the runtime's protocol
(:mod:`moirai.runtime.protocol`) sends it and the cost model (:mod:`moirai.cluster.cost`) prices it from this."""

import numpy as np

# A header's fields, in the order they are sent, each one number of HEADER_DTYPE.
HEADER_FIELDS = ("kind", "program_id", "payload_bytes", "request", "timeout_ms")
HEADER_DTYPE = "int64"
# After the fields: the payload's SHA-256, then the header's HMAC under the run's secret, each this many numbers.
DIGEST_WORDS = 32 // np.dtype(HEADER_DTYPE).itemsize
HEADER_WORDS = len(HEADER_FIELDS) + 2 * DIGEST_WORDS
HEADER_BYTES = HEADER_WORDS * np.dtype(HEADER_DTYPE).itemsize
