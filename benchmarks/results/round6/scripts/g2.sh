#!/usr/bin/env bash
# Session 6, call 2: peer chunk 2 only.
cp .peer/d2/* /tmp/peer-chunks/ && ls /tmp/peer-chunks | wc -l
