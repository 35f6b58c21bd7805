"""Why a kernel is as fast as it is: profiles, the explanation of a win, compute-sanitizer."""
