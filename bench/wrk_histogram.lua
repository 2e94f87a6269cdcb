-- wrk script for bench/run.sh: when a run ends, writes its totals and its whole latency histogram
-- (one "microseconds count" line per distinct latency) to the file named by WRK_HISTOGRAM, so that
-- several short runs of one target can be merged into exact percentiles. It defines no request or
-- response function, so wrk's request path stays the same as without a script.
done = function(summary, latency, requests)
  local f = assert(io.open(os.getenv("WRK_HISTOGRAM"), "w"))
  local e = summary.errors
  f:write(string.format("requests %d\nduration_us %d\nnon2xx %d\nerrors %d\n", summary.requests,
    summary.duration, e.status, e.connect + e.read + e.write + e.timeout))
  for i = 1, #latency do
    local value, count = latency(i)
    f:write(string.format("%d %d\n", value, count))
  end
  f:close()
end
