"""The decision: tokenize a request, match it against the index, score the candidates, pick one."""
