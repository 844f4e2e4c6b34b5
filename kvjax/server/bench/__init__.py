"""Load against a server: the benchmark client, its workloads, and C18's diagnosis.

Layer 10 with the server; imported by kvjax/cli/ only.
"""
