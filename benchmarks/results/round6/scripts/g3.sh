#!/usr/bin/env bash
# Session 6, call 3: peer chunk 3 only.
cp .peer/d3/* /tmp/peer-chunks/ && ls /tmp/peer-chunks | wc -l
