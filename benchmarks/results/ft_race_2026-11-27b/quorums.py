"""Quorum to quorum from a run's rank-0 log (the lighthouse's lines): when each replica asked,
how long the quorum waited for the last one, and the seconds since the previous quorum.

    python quorums.py <(gunzip -c slK.log.gz) FIRST LAST   # quorums FIRST..LAST-1
"""

import datetime
import re
import sys

ASKED = re.compile(r"(\S+) \[INFO\] \[torchft::lighthouse\] - Received quorum request for replica (replica_\d)")
FORMED = re.compile(r"(\S+) .*Quorum! Quorum \{ quorum_id: (\d+)")


def quorums(lines: list[str]) -> list[tuple]:
    events, out, asked, previous = [], [], [], None
    for line in lines:
        if m := ASKED.match(line):
            events.append((datetime.datetime.fromisoformat(m.group(1)), m.group(2)))
        elif m := FORMED.match(line):
            events.append((datetime.datetime.fromisoformat(m.group(1)), "Q" + m.group(2)))
    for when, who in events:
        if not who.startswith("Q"):
            asked.append((when, who))
            continue
        if asked:
            first = asked[0][0]
            order = [(w[-1], round((t - first).total_seconds(), 2)) for t, w in asked]
            since = round((when - previous).total_seconds(), 2) if previous else 0.0
            out.append((first.time(), order, who, round((when - first).total_seconds(), 2), since))
        previous, asked = when, []
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        rows = quorums(f.read().splitlines())
    for start, order, quorum, wait, since in rows[int(sys.argv[2]) : int(sys.argv[3])]:
        print(start, order, quorum, "wait", wait, "since previous", since)
