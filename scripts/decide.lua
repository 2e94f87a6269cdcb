-- decide.lua: one all-or-nothing rate-limit decision for every policy of a request, atomically.
--
-- This is docs/algorithms.md for Redis. The in-process store (src/limiter/algorithm.rs) does the
-- same IEEE-754 double arithmetic in the same order, so both give the same outcome to the
-- microsecond; tests/conformance.rs holds them to it.
--
-- KEYS[i]  the counter key of policy i, built by the gateway (hash tag + kind suffix, so one key
--          always holds one data type). The script never builds a key name.
-- ARGV[1]  "now" in microseconds for tests; "" in production: the clock is Redis TIME, never a
--          gateway's, so instances whose clocks disagree still share one limit.
-- then per policy i, from ARGV[2 + 6*(i-1)]: kind, p1, p2, p3, cost, shadow
--          tb: p1 = rate per second (decimal), p2 = burst, p3 = 0
--          sw: p1 = limit, p2 = window in microseconds, p3 = buckets (0 = exact log)
--          cc: p1 = limit, p2 = lease TTL in microseconds, p3 = the lease id to take (< 2^53)
--          q:  p1 = limit, p2 = period start, p3 = period end (epoch microseconds, computed by
--              the gateway in the quota's time zone: Lua has no time-zone database); a paced
--              quota's kind is instead the end of the period after it, negated (a number)
--          cost: units to consume, 0 checks without consuming
--          shadow: "1" for report only (Envoy's shadow_mode): its refusal never rejects the
--                  request, and it consumes only when it allows and the request is admitted
--
-- Reply: {allowed_all, then per policy: allowed, limit, remaining, reset_us, retry_after_us,
--         then per policy a refund stamp of two integers (meaningful when it consumed):
--         tb: 0, 0; sw: the time written, 0; swb: the bucket index, 0;
--         cc: the lease id, 0; q: the period start, 0}.
--
-- Charge (cost from the response; docs/algorithms.md): ARGV[1] "charge", then the ARGV above.
-- Every policy's cost is consumed whatever its counter holds (a bucket may go below zero, a
-- window past its limit). Same reply.
--
-- Batch (concurrent requests in one call, src/limiter/redis/batch.rs): ARGV[1] "batch", then per
-- decision: now ("" for TIME), the number of its keys n, and 6 ARGV per key as above; KEYS are
-- the decisions' keys one after another. The decisions run in order, each all-or-nothing on its
-- own. Reply: the decisions' replies one after another.
--
-- Packed batch (the gateway's usual call): ARGV[1] "packed", ARGV[2] the batch's ARGV after
-- "batch" as little-endian doubles, 8 bytes each: now (negative for Redis TIME), n, then per key
-- kind (1 tb, 2 sw, 3 cc, 4 q), p1, p2, p3, cost, shadow (1 or 0). The same decisions as "batch";
-- the reply is the same integers as one string of little-endian doubles (the gateway truncates
-- each toward zero, as Redis does a Lua number it returns as an integer). struct reads and writes
-- them in C: two arguments and one reply string instead of eight values per decision, with no
-- decimal to split, parse or print on either side.
--
-- Peek (the status page's lookup and the quota endpoint): ARGV[1] "peek", then the ARGV above.
-- Every policy is evaluated as a decision would and reported as a decision refusing the request
-- reports it (the state now; allowed and retry_after for its cost), and nothing is written: no
-- key, member, field or TTL (expired window members and leases are skipped, not removed). Same
-- reply.
--
-- Refund: ARGV[1] "refund", then per key from ARGV[2 + 5*(i-1)]: kind, cost, burst (tb) or 0,
-- stamp1, stamp2 (the stamp the decision's reply gave). Gives back at most `cost` of what that
-- decision consumed from KEYS[i], where it consumed it: tokens capped at the burst (no stamp
-- needed); the exact window's member of the time written (later members renumbered); the
-- bucketed window's bucket; the quota's count while it is still in the period stamped (a later
-- period gets nothing); the lease, which is how a finished request releases it. Reply: {1}.
-- Redis Cluster uses it for a request whose counters span slots (docs/redis.md); the gateway to
-- settle a reservation (`reserve: true`, docs/algorithms.md "Reserve, then settle"), giving
-- back the units the response did not use.
-- A paced bucket's reservation (docs/algorithms.md "Pacing") has its slot as stamp1: it is given
-- back only while the bucket's state is as of that slot (no reservation behind it). A paced
-- window's has stamp2 = 1: its member or bucket stays, with the units taken off.
--
-- Every policy is evaluated from the stored state first; only if all allow (shadow policies aside)
-- is anything written, so a rejected request consumes nothing anywhere. Every written key gets a
-- PEXPIRE (a run of single-bucket decisions on one bucket writes it once, at the run's end).

-- Writes after TIME must replicate as effects (needed before Redis 5; a no-op since).
if redis.replicate_commands then
  pcall(redis.replicate_commands)
end

-- The hot path's library functions as locals: a global is a table lookup on every use.
local call, format, tonumber = redis.call, string.format, tonumber
local ceil, floor, min = math.ceil, math.floor, math.min

local MICROS = 1000000.0
-- True for a peek: the evaluations below write nothing and no plan is consumed.
local peeking = false
-- True for a charge: every policy consumes, none paces.
local force_all = false
-- Lua numbers become Redis integers by a C cast: keep absurd durations (a rate near zero) in range.
local MAX_US = 4611686018427387904.0

local function ceil_us(us)
  if us <= 0 then
    return 0
  end
  local c = math.ceil(us)
  if c > MAX_US then
    return MAX_US
  end
  return c
end

-- A limit lowered by a config reload can leave more units counted than it allows.
local function left(limit, used)
  if used > limit then
    return 0
  end
  return limit - used
end

local function int(x)
  return string.format('%d', x)
end

-- Key TTL in milliseconds: the time the state still matters, rounded up, plus one second.
local function ttl_ms(us)
  return math.ceil(us / 1000) + 1000
end

---------------------------------------------------------------------------------------------------
-- Token bucket: HASH {t = tokens (%.17g), ts = microseconds}.

local function tb_eval(key, rate, burst, cost, now)
  local h = call('HMGET', key, 't', 'ts')
  local tokens, ts = burst, now
  if h[1] and h[2] then
    tokens, ts = tonumber(h[1]), tonumber(h[2])
  end
  local elapsed = now - ts
  if elapsed < 0 then
    elapsed = 0
  end
  tokens = min(burst, tokens + elapsed * rate / MICROS)
  if ts < now then
    ts = now
  end
  -- Every field the outcome and commit set is in the constructor: a table that grows rehashes.
  return { key = key, rate = rate, burst = burst, cost = cost, now = now,
           tokens = tokens, ts = ts, allowed = tokens >= cost, reset = 0 }
end

local function tb_outcome(p, consumed)
  local after = p.tokens
  if consumed then
    after = p.tokens - p.cost
  end
  local reset = ceil_us((p.burst - after) * MICROS / p.rate)
  local retry = 0
  if not p.allowed then
    if p.cost > p.burst then
      retry = reset
    else
      retry = ceil_us((p.cost - p.tokens) * MICROS / p.rate)
    end
  end
  p.reset = reset
  -- A charge after the response may leave the bucket below zero: nothing is left.
  local remaining = floor(after)
  if remaining < 0 then
    remaining = 0
  end
  return p.burst, remaining, reset, retry
end

local function tb_commit(p)
  call('HSET', p.key, 't', format('%.17g', p.tokens - p.cost), 'ts', format('%d', p.ts))
  -- The bucket refills from ts, which a stepped-back clock can put in the future (ttl_ms).
  call('PEXPIRE', p.key, ceil((p.reset + (p.ts - p.now)) / 1000) + 1000)
end

---------------------------------------------------------------------------------------------------
-- Exact sliding window: ZSET, one member per distinct time at which units were admitted, named
-- "t#c" and scored t (µs), where c counts the units admitted up to and including that time,
-- from a base; plus the member "n" scored -(base + 1) (so below every time: time ranges start at
-- 0). The count in the window is c of the newest member less the c of the newest expired one
-- (or the base, when none is left): two reads, whatever the members or units.
--
-- A decision or charge of any cost writes one member: t is never below the newest score (a write
-- is at max(now, newest)), so units written at the newest time rename that member (ZREM and ZADD)
-- and any other time gets a new one. Expired members are removed with one ZREMRANGEBYSCORE, the
-- newest of them becoming the base. Only a refusal's retry_after walks members, oldest first,
-- until they free enough units; only a refund rewrites the members after the one it corrects
-- (written within its round trip, so few). Past 2^51, once 2^50 units have left the window,
-- the live members are renumbered from 0, so c stays an exact double (below 2^53) as long as the
-- limit is below 2^51.

local SW_BASE = 'n'
local SW_RENUMBER = 2251799813685248

-- The cumulative units a member's name carries.
local function sw_cum(member)
  return tonumber(string.match(member, '#(%d+)$')) or 0
end

-- The member "n" for base b.
local function sw_base_score(b)
  return int(-(b + 1))
end

local function sw_eval(key, limit, window, cost, now)
  local newest = call('ZRANGE', key, -1, -1, 'WITHSCORES')
  local t = now
  local newest_ts, newest_member, top = nil, nil, nil
  if newest[2] then
    local score = tonumber(newest[2])
    if score >= 0 then
      newest_ts, newest_member, top = score, newest[1], sw_cum(newest[1])
      if score > t then
        t = score
      end
    end
  end
  local cutoff = t - window
  -- Live members are scored above `from`; "n" (scored -1 or below) never is.
  local from = cutoff
  if from < -1 then
    from = -1
  end
  local base, dirty = 0, false
  if newest_ts and newest_ts <= cutoff then
    -- Every member has left the window.
    if not peeking then
      call('DEL', key)
    end
    newest_ts, newest_member = nil, nil
  elseif newest_ts then
    -- The newest expired member, or else "n": the base the count is measured from.
    local low = call('ZREVRANGEBYSCORE', key, int(from), '-inf', 'WITHSCORES', 'LIMIT', 0, 1)
    if low[2] then
      local score = tonumber(low[2])
      if score < 0 then
        base = -score - 1
      else
        base = sw_cum(low[1])
        -- A peek counts from the expired member without removing it.
        if not peeking then
          dirty = true
          call('ZREMRANGEBYSCORE', key, 0, int(from))
        end
      end
    end
  end
  local count = 0
  if newest_ts then
    count = top - base
  end
  -- dirty: "n" is out of date, written by the commit or else by the outcome (and by decide()
  -- when a later check's arguments are bad), so it costs no command of its own.
  return { key = key, limit = limit, window = window, cost = cost, now = now, t = t,
           from = from, count = count, base = base, newest_ts = newest_ts,
           newest_member = newest_member, dirty = dirty, allowed = count + cost <= limit }
end

local function sw_write_base(p)
  call('ZADD', p.key, sw_base_score(p.base), SW_BASE)
end

local function sw_outcome(p, consumed)
  if p.dirty and not (consumed and p.cost > 0) then
    sw_write_base(p)
  end
  local after = p.count
  local newest = nil
  if p.count > 0 then
    newest = p.newest_ts
  end
  if consumed then
    after = p.count + p.cost
    if p.cost > 0 then
      newest = p.t
    end
  end
  local reset = 0
  if newest then
    reset = newest + p.window - p.t
  end
  local retry = 0
  if not p.allowed then
    retry = p.window
    if p.cost <= p.limit then
      -- The oldest members leave first: wait for the one that frees enough units (whose c
      -- reaches base + excess), reading them a page at a time, each twice the last (times are
      -- distinct, so a page starts after the last one's score). The first is usually enough.
      local need = p.base + p.count + p.cost - p.limit
      local from, size, done = '(' .. int(p.from), 2, false
      while not done do
        local page = call('ZRANGEBYSCORE', p.key, from, '+inf', 'WITHSCORES', 'LIMIT', 0, size)
        for i = 1, #page, 2 do
          if sw_cum(page[i]) >= need then
            retry = tonumber(page[i + 1]) + p.window - p.t
            done = true
            break
          end
        end
        if #page < 2 * size then
          done = true
        else
          from = '(' .. page[#page]
          size = min(2 * size, 256)
        end
      end
    end
  end
  return p.limit, left(p.limit, after), reset, retry
end

local function sw_commit(p)
  local base = p.base
  local c = base + p.count + p.cost
  if p.newest_ts == p.t then
    call('ZREM', p.key, p.newest_member)
  end
  if c >= SW_RENUMBER and base >= SW_RENUMBER / 2 then
    -- Renumber the live members from 0 (at least 2^50 units have left the window since the
    -- last time: amortised O(1)).
    local live = call('ZRANGEBYSCORE', p.key, 0, '+inf', 'WITHSCORES')
    for i = 1, #live, 2 do
      call('ZREM', p.key, live[i])
      call('ZADD', p.key, live[i + 1], live[i + 1] .. '#' .. int(sw_cum(live[i]) - base))
    end
    c, base = c - base, 0
  end
  local score = int(p.t)
  call('ZADD', p.key, score, score .. '#' .. int(c), sw_base_score(base), SW_BASE)
  call('PEXPIRE', p.key, ttl_ms(p.t - p.now + p.window))
end

---------------------------------------------------------------------------------------------------
-- Bucketed sliding window: HASH bucket index -> units, buckets older than b - N deleted.

local function swb_eval(key, limit, window, n, cost, now)
  local width = window / n
  local raw = redis.call('HGETALL', key)
  local all = {}
  local maxj = nil
  for i = 1, #raw, 2 do
    local j, c = tonumber(raw[i]), tonumber(raw[i + 1])
    all[#all + 1] = { j, c }
    if maxj == nil or j > maxj then
      maxj = j
    end
  end
  table.sort(all, function(a, b) return a[1] < b[1] end)
  local current = (now - math.fmod(now, width)) / width
  if maxj and maxj > current then
    current = maxj
  end
  local oldest = current - n
  if oldest < 0 then
    oldest = 0
  end
  local live, stale, count = {}, {}, 0
  for _, e in ipairs(all) do
    if e[1] < oldest then
      stale[#stale + 1] = int(e[1])
    elseif e[2] > 0 then
      live[#live + 1] = e
      count = count + e[2]
    end
  end
  return { key = key, limit = limit, window = window, n = n, width = width, cost = cost,
           now = now, current = current, live = live, stale = stale, count = count,
           allowed = count + cost <= limit }
end

local function swb_until_gone(p, j)
  local us = (j + p.n + 1) * p.width - p.now
  if us < 0 then
    return 0
  end
  return us
end

local function swb_outcome(p, consumed)
  local after = p.count
  local newest = nil
  if #p.live > 0 then
    newest = p.live[#p.live][1]
  end
  if consumed then
    after = p.count + p.cost
    if p.cost > 0 then
      newest = p.current
    end
  end
  local reset = 0
  if newest then
    reset = swb_until_gone(p, newest)
  end
  local retry = 0
  if not p.allowed then
    retry = p.window
    if p.cost <= p.limit then
      local excess = p.count + p.cost - p.limit
      local freed = 0
      for _, e in ipairs(p.live) do
        freed = freed + e[2]
        if freed >= excess then
          retry = swb_until_gone(p, e[1])
          break
        end
      end
    end
  end
  return p.limit, left(p.limit, after), reset, retry
end

local function swb_commit(p)
  redis.call('HINCRBY', p.key, int(p.current), p.cost)
  if #p.stale > 0 then
    redis.call('HDEL', p.key, unpack(p.stale))
  end
  local us = (p.current + p.n + 1) * p.width - p.now
  if us < p.window + p.width then
    us = p.window + p.width
  end
  redis.call('PEXPIRE', p.key, ttl_ms(us))
end

---------------------------------------------------------------------------------------------------
-- Concurrency: ZSET, one member per lease (its id), scored by when it expires in microseconds.
-- Expired leases are removed by every decision, so a crashed instance's leases stop counting
-- after their TTL; a finished request removes its own (refund below).

local function cc_eval(key, limit, ttl, lease, cost, now)
  local count
  if peeking then
    count = redis.call('ZCOUNT', key, '(' .. int(now), '+inf')
  else
    redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now))
    count = redis.call('ZCARD', key)
  end
  return { key = key, limit = limit, ttl = ttl, lease = lease, cost = cost, now = now,
           count = count, allowed = count + cost <= limit }
end

local function cc_last(key)
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if last[2] then
    return tonumber(last[2])
  end
  return nil
end

local function cc_outcome(p, consumed)
  local after = p.count
  local last = cc_last(p.key)
  if consumed and p.cost > 0 then
    after = p.count + p.cost
    last = p.now + p.ttl
  end
  local reset = 0
  if last and last > p.now then
    reset = last - p.now
  end
  local retry = 0
  if not p.allowed then
    retry = 1000000
  end
  return p.limit, left(p.limit, after), reset, retry
end

local function cc_commit(p)
  redis.call('ZADD', p.key, int(p.now + p.ttl), int(p.lease))
  -- The key lives as long as its last lease (a reload may have shortened the TTL since).
  redis.call('PEXPIRE', p.key, ttl_ms(cc_last(p.key) - p.now))
end

-- Calendar quota: HASH {p = period start, e = period end (epoch microseconds), n = units used},
-- and while a paced decision has reserved units in the period after it (starting at e):
-- x = those units, xe = that period's end.
--
-- The counter never goes back to an older period: a gateway whose clock lags keeps counting in
-- the newest period any instance reached; one whose period starts at e takes x as used. Redis
-- TIME only measures the time to the period end.

-- Kept past the period end so a gateway clock that lags by up to this much still finds the count.
local QUOTA_MARGIN_US = 60000000

-- next_stop: the end of the period after [start, stop) for a paced quota, else false.
local function q_eval(key, limit, start, stop, cost, now, next_stop)
  local h = redis.call('HMGET', key, 'p', 'e', 'n', 'x', 'xe')
  local used, x, xe = 0, 0, 0
  if h[1] and h[2] and h[3] then
    if tonumber(h[1]) >= start then
      start, stop, used = tonumber(h[1]), tonumber(h[2]), tonumber(h[3])
      x, xe = tonumber(h[4] or '0'), tonumber(h[5] or '0')
    elseif tonumber(h[2]) == start then
      -- The counter moves into the period it reserved units in.
      used = tonumber(h[4] or '0')
    end
  end
  return { key = key, limit = limit, period = start, stop = stop, used = used, cost = cost,
           now = now, allowed = used + cost <= limit, x = x, xe = xe, had_x = h[4] ~= false,
           next_stop = next_stop }
end

local function q_outcome(p, consumed)
  local after = p.used
  if consumed then
    after = p.used + p.cost
  end
  local to_end = p.stop - p.now
  if to_end < 0 then
    to_end = 0
  end
  local reset, retry = 0, 0
  if after > 0 then
    reset = to_end
  end
  if not p.allowed then
    retry = to_end
  end
  return p.limit, left(p.limit, after), reset, retry
end

local function q_commit(p)
  redis.call('HSET', p.key, 'p', int(p.period), 'e', int(p.stop), 'n', int(p.used + p.cost))
  local until_us = p.stop
  if p.x > 0 then
    redis.call('HSET', p.key, 'x', int(p.x), 'xe', int(p.xe))
    until_us = p.xe
  elseif p.had_x then
    redis.call('HDEL', p.key, 'x', 'xe')
  end
  local us = until_us - p.now
  if us < 0 then
    us = 0
  end
  redis.call('PEXPIRE', p.key, ttl_ms(us + QUOTA_MARGIN_US))
end

---------------------------------------------------------------------------------------------------
-- Refund: undo one consumption, identified by its stamp.

local function refund(key, kind, cost, burst, s1, s2)
  if kind == 'tb' then
    local h = redis.call('HMGET', key, 't', 'ts')
    local t = h[1]
    -- A paced reservation (s1: its slot) comes back only while it is the bucket's latest: a later
    -- one was placed behind it, and the bucket may have been full in between (pacing.rs).
    if s1 > 0 and tonumber(h[2]) ~= s1 then
      t = nil
    end
    -- An expired bucket is full again: nothing to give back.
    if t then
      local tokens = math.min(burst, tonumber(t) + cost)
      redis.call('HSET', key, 't', string.format('%.17g', tokens))
    end
  elseif kind == 'sw' then
    -- The member of the time written loses the call's units, and so does the count of every
    -- later member; other units admitted at that time stay.
    local at = int(s1)
    local member = call('ZRANGEBYSCORE', key, at, at)[1]
    if member then
      local prev = call('ZREVRANGEBYSCORE', key, '(' .. at, '-inf', 'WITHSCORES', 'LIMIT', 0, 1)
      local before = 0
      if prev[2] then
        if tonumber(prev[2]) < 0 then
          before = -tonumber(prev[2]) - 1
        else
          before = sw_cum(prev[1])
        end
      end
      local back = min(cost, sw_cum(member) - before)
      local later = call('ZRANGEBYSCORE', key, at, '+inf', 'WITHSCORES')
      for j = 1, #later, 2 do
        local c = sw_cum(later[j]) - back
        call('ZREM', key, later[j])
        -- A paced reservation (s2 = 1) keeps its member with no units: the members its
        -- decision found expired at the slot stay forgotten only while a member that late holds
        -- the window's time (pacing.rs).
        if j > 1 or c > before or s2 == 1 then
          call('ZADD', key, later[j + 1], later[j + 1] .. '#' .. int(c))
        end
      end
      -- Only "n" left: the window is empty.
      if s2 ~= 1 and call('ZCARD', key) <= 1 then
        call('DEL', key)
      end
    end
  elseif kind == 'cc' then
    redis.call('ZREM', key, int(s1))
  elseif kind == 'q' then
    -- Only while the counter is still in the period that was charged, or (a paced reservation)
    -- in the period before it, which holds it as x.
    local h = redis.call('HMGET', key, 'p', 'n', 'e', 'x')
    local field, units = nil, nil
    if h[1] and h[2] and tonumber(h[1]) == s1 then
      field, units = 'n', tonumber(h[2])
    elseif h[3] and h[4] and tonumber(h[3]) == s1 then
      field, units = 'x', tonumber(h[4])
    end
    if field then
      local n = units - cost
      if n < 0 then
        n = 0
      end
      redis.call('HSET', key, field, int(n))
    end
  elseif kind == 'swb' then
    local field = int(s1)
    local units = tonumber(redis.call('HGET', key, field) or '0')
    if s2 == 1 then
      -- A paced reservation's bucket stays, emptied: it holds the window's time (as sw above).
      if units > 0 then
        redis.call('HINCRBY', key, field, -min(units, cost))
      end
    elseif units <= cost then
      redis.call('HDEL', key, field)
    else
      redis.call('HINCRBY', key, field, -cost)
    end
  else
    return false
  end
  return true
end

-- Renew (a request still running): ARGV[1] "renew", ARGV[2] now ("" for TIME), then per key from
-- ARGV[3 + 2*(i-1)]: lease TTL (µs), lease id. A lease still held expires at now + TTL again; an
-- expired or released one stays gone. Reply: {1}.
if ARGV[1] == 'renew' then
  if #ARGV ~= 2 + 2 * #KEYS then
    return redis.error_reply('decide.lua: expected 2 + 2 ARGV per key to renew')
  end
  local now
  if ARGV[2] ~= '' then
    now = tonumber(ARGV[2])
  else
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  end
  for i = 1, #KEYS do
    local ttl, lease = tonumber(ARGV[1 + 2 * i]), ARGV[2 + 2 * i]
    local score = redis.call('ZSCORE', KEYS[i], lease)
    if ttl and score and tonumber(score) > now then
      redis.call('ZADD', KEYS[i], 'XX', int(now + ttl), lease)
      redis.call('PEXPIRE', KEYS[i], ttl_ms(cc_last(KEYS[i]) - now))
    end
  end
  return { 1 }
end

---------------------------------------------------------------------------------------------------
-- Waiting for a lease (a concurrency policy with on_limit: delay; docs/algorithms.md "Pacing",
-- src/limiter/lease_queue.rs is the spec). KEYS come in pairs: the lease ZSET and its queue, a
-- LIST of tickets "lease:deadline:instance", oldest first, in the same hash slot. A lease that
-- comes free goes, in the same call, to the oldest ticket whose deadline has not passed: its
-- lease is added and its id PUBLISHed on the channel of its waiter's instance (ARGV[3] ..
-- instance), which wakes the waiter. Tickets past their deadline (a waiter that died with its
-- instance) are dropped on the way.

local function now_arg(arg)
  if arg ~= '' then
    return tonumber(arg)
  end
  local t = call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local function cc_hand_on(key, queue, limit, ttl, now, channel, handed_ids)
  call('ZREMRANGEBYSCORE', key, '-inf', int(now))
  local count = call('ZCARD', key)
  local handed = false
  while count < limit do
    local ticket = call('LPOP', queue)
    if not ticket then
      break
    end
    local lease, deadline, instance = string.match(ticket, '^(%d+):(%d+):(.+)$')
    if lease and tonumber(deadline) > now then
      call('ZADD', key, int(now + ttl), lease)
      call('PUBLISH', channel .. instance, lease)
      count, handed = count + 1, true
      handed_ids[#handed_ids + 1] = tonumber(lease)
    end
  end
  if handed then
    call('PEXPIRE', key, ttl_ms(cc_last(key) - now))
  end
  return count
end

-- Enqueue (a request the decision refused on this key): ARGV[1] "enqueue", ARGV[2] now ("" for
-- TIME), ARGV[3] the wake channels' prefix, then limit, lease TTL (µs), the lease id, max_delay
-- (µs), the waiter's instance. Leases free now go to the tickets already queued first; one still
-- free is taken under the lease id (reply {1, 0}); else a ticket is queued (reply {0, deadline}).
if ARGV[1] == 'enqueue' then
  if #KEYS ~= 2 or #ARGV ~= 8 then
    return redis.error_reply('decide.lua: expected 2 KEYS and 8 ARGV to enqueue')
  end
  local now = now_arg(ARGV[2])
  local limit, ttl, wait = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[7])
  local lease = ARGV[6]
  if not (now and limit and ttl and wait and string.match(lease, '^%d+$')) then
    return redis.error_reply('decide.lua: bad enqueue')
  end
  if cc_hand_on(KEYS[1], KEYS[2], limit, ttl, now, ARGV[3], {}) < limit then
    call('ZADD', KEYS[1], int(now + ttl), lease)
    call('PEXPIRE', KEYS[1], ttl_ms(cc_last(KEYS[1]) - now))
    return { 1, 0 }
  end
  local deadline = now + wait
  call('RPUSH', KEYS[2], lease .. ':' .. int(deadline) .. ':' .. ARGV[8])
  -- The queue lives as long as its latest deadline.
  if call('PTTL', KEYS[2]) < ttl_ms(wait) then
    call('PEXPIRE', KEYS[2], ttl_ms(wait))
  end
  return { 0, deadline }
end

-- Release (a request ended, or a waiter gave up): ARGV[1] "release", ARGV[2] now ("" for TIME),
-- ARGV[3] the wake channels' prefix, then per pair of KEYS: limit, lease TTL (µs), the lease id,
-- the waiter's ticket ("" for a request that held its lease). The ticket leaves the queue, the
-- lease the ZSET (whichever holds it), and the leases free go to the oldest live tickets. Reply:
-- {1, then the ids of the leases handed on}.
if ARGV[1] == 'release' then
  if #KEYS % 2 ~= 0 or #ARGV ~= 3 + 2 * #KEYS then
    return redis.error_reply('decide.lua: expected pairs of KEYS and 4 ARGV per pair to release')
  end
  local now = now_arg(ARGV[2])
  local reply = { 1 }
  for i = 1, #KEYS / 2 do
    local a = 4 + 4 * (i - 1)
    local key, queue = KEYS[2 * i - 1], KEYS[2 * i]
    local limit, ttl, lease, ticket = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), ARGV[a + 2],
                                      ARGV[a + 3]
    if not (now and limit and ttl) then
      return redis.error_reply('decide.lua: bad release for pair ' .. i)
    end
    if ticket ~= '' then
      call('LREM', queue, 1, ticket)
    end
    call('ZREM', key, lease)
    -- Nobody waiting (the usual release): nothing more to do.
    if call('LLEN', queue) > 0 then
      cc_hand_on(key, queue, limit, ttl, now, ARGV[3], reply)
    end
  end
  return reply
end

if ARGV[1] == 'refund' then
  if #ARGV ~= 1 + 5 * #KEYS then
    return redis.error_reply('decide.lua: expected 1 + 5 ARGV per key to refund')
  end
  for i = 1, #KEYS do
    local a = 2 + 5 * (i - 1)
    local cost, burst, s1, s2 = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]),
                                tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
    if not (cost and burst and s1 and s2) or cost < 0 then
      return redis.error_reply('decide.lua: bad refund for key ' .. i)
    end
    if cost > 0 and not refund(KEYS[i], ARGV[a], cost, burst, s1, s2) then
      return redis.error_reply('decide.lua: unknown kind to refund for key ' .. i)
    end
  end
  return { 1 }
end

---------------------------------------------------------------------------------------------------

-- The decision's arguments, with every number already a number (kinds stay strings): see
-- `numeric` and "Packed batch" below.
local argv = {}

-- The plans of the decision being made, and each plan's outcome and commit functions: reused by
-- every decision of a call (only indices 1..policies are read), so a decision allocates no lists.
local plans, outcomes, commits = {}, {}, {}

-- The bucket of the last single-bucket decision, kept across decisions of this call: a batch of
-- concurrent requests is often one busy client's, and a run of decisions on one bucket then reads
-- it once and writes it once, instead of an HMGET, an HSET and a PEXPIRE each (docs/redis.md).
-- Exact: the script is atomic, every other reader or writer of a bucket in this call flushes it
-- first, and the values kept are the ones a read would give back (the %.17g written parses back to
-- the same double; ts is kept truncated, as %d writes it).
-- bucket_t is false for a key Redis does not hold (a full bucket); bucket_ttl, the TTL in ms the
-- last commit asked for, is nil while nothing is left to write.
local bucket_key, bucket_t, bucket_ts, bucket_ttl = nil, nil, nil, nil

-- Writes the kept bucket if a decision committed to it, and forgets it.
local function flush()
  if bucket_ttl then
    call('HSET', bucket_key, 't', format('%.17g', bucket_t), 'ts', format('%d', bucket_ts))
    call('PEXPIRE', bucket_key, bucket_ttl)
  end
  bucket_key, bucket_ttl = nil, nil
end

-- Bad arguments for policy i: the decision fails. An exact window checked before it may have
-- removed expired members (sw_eval), so its total is written first.
local function bad(i, what)
  for j = 1, i - 1 do
    local p = plans[j]
    if p.dirty then
      sw_write_base(p)
    end
  end
  return nil, redis.error_reply('decide.lua: ' .. what .. ' for policy ' .. i)
end

-- Policy i's plan from its six arguments at argv[a], its key `key`, evaluated at `now`; sets its
-- outcome and commit functions. Nil and an error reply on bad arguments.
local function eval_policy(i, key, a, now)
  local kind = argv[a]
  local p1, p2, p3, cost = argv[a + 1], argv[a + 2], argv[a + 3], argv[a + 4]
  if not (p1 and p2 and p3 and cost) or cost < 0 then
    return bad(i, 'bad arguments')
  end
  local p
  if kind == 'tb' then
    if not (p1 > 0) or p2 < 0 then
      return bad(i, 'bad token bucket')
    end
    p = tb_eval(key, p1, p2, cost, now)
    outcomes[i], commits[i] = tb_outcome, tb_commit
  elseif kind == 'sw' then
    if p2 <= 0 or p3 < 0 or (p3 > 0 and math.fmod(p2, p3) ~= 0) then
      return bad(i, 'bad sliding window')
    end
    if p3 == 0 then
      p = sw_eval(key, p1, p2, cost, now)
      outcomes[i], commits[i] = sw_outcome, sw_commit
    else
      p = swb_eval(key, p1, p2, p3, cost, now)
      outcomes[i], commits[i] = swb_outcome, swb_commit
    end
  elseif kind == 'cc' then
    if p1 < 0 or p2 <= 0 or p3 < 0 then
      return bad(i, 'bad concurrency')
    end
    p = cc_eval(key, p1, p2, p3, cost, now)
    outcomes[i], commits[i] = cc_outcome, cc_commit
  elseif kind == 'q' or (tonumber(kind) or 0) < 0 then
    -- A paced quota's kind is its next period's end, negated.
    local next_stop = kind ~= 'q' and -tonumber(kind)
    if p1 < 0 or p2 < 0 or p3 <= p2 or (next_stop and next_stop <= p3) then
      return bad(i, 'bad quota')
    end
    p = q_eval(key, p1, p2, p3, cost, now, next_stop)
    outcomes[i], commits[i] = q_outcome, q_commit
  else
    return bad(i, 'unknown kind')
  end
  return p
end

---------------------------------------------------------------------------------------------------
-- Pacing (docs/algorithms.md "Pacing"; src/limiter/pacing.rs): a policy whose mode is PACED +
-- max_delay (µs) may admit a request it would refuse, for the earliest slot its algorithm has
-- free, when that is within max_delay. A request waits for the latest slot of its policies and
-- reserves in all of them there, or in none. Token buckets keep their state as of the slot they
-- reserved (ts in the future), windows record the request at the slot: every later request is
-- evaluated from there and queues behind. A quota paces across one period boundary: refused in its
-- period, it takes a unit of the next one (x) when that has room, and its slot is that period's
-- start. Concurrency does not pace here.

local PACED = 2

-- The earliest time each algorithm admits p's cost (nil: never, a cost above the limit).
local function tb_slot(p)
  if p.allowed then
    return p.ts
  end
  if p.cost > p.burst then
    return nil
  end
  return p.ts + ceil_us((p.cost - p.tokens) * MICROS / p.rate)
end

local function sw_slot(p)
  if p.allowed then
    return p.t
  end
  if p.cost > p.limit then
    return nil
  end
  local _, _, _, retry = sw_outcome(p, false)
  return p.t + retry
end

local function swb_slot(p)
  if p.allowed then
    local start = p.current * p.width
    if start > p.now then
      return start
    end
    return p.now
  end
  if p.cost > p.limit then
    return nil
  end
  local _, _, _, retry = swb_outcome(p, false)
  return p.now + retry
end

-- Now when the quota has room, else the next period's start when the units reserved there leave
-- room (nil without a next period from the gateway: p.next_stop).
local function q_slot(p)
  if p.allowed then
    return p.now
  end
  if p.next_stop and p.x + p.cost <= p.limit then
    return p.stop
  end
  return nil
end

-- Reserve p's cost at `at` and return the outcome of the request decided there.
local function tb_reserve(p, at)
  local elapsed = at - p.ts
  if elapsed < 0 then
    elapsed = 0
  end
  p.tokens = min(p.burst, p.tokens + elapsed * p.rate / MICROS)
  if at > p.ts then
    p.ts = at
  end
  p.allowed = true
  local limit, remaining, reset, retry = tb_outcome(p, true)
  if p.cost > 0 then
    tb_commit(p)
  end
  return limit, remaining, reset, retry
end

local function sw_reserve(p, at)
  -- The expired members p's evaluation removed: its base goes first.
  if p.dirty then
    sw_write_base(p)
    p.dirty = false
  end
  local q = sw_eval(p.key, p.limit, p.window, p.cost, at)
  q.allowed = true
  local limit, remaining, reset, retry = sw_outcome(q, true)
  -- The key's TTL counts from the real now.
  q.now = p.now
  if q.cost > 0 then
    sw_commit(q)
  end
  p.t = q.t
  return limit, remaining, reset, retry
end

local function swb_reserve(p, at)
  local q = swb_eval(p.key, p.limit, p.window, p.n, p.cost, at)
  q.allowed = true
  local limit, remaining, reset, retry = swb_outcome(q, true)
  q.now = p.now
  if q.cost > 0 then
    swb_commit(q)
  end
  p.current = q.current
  return limit, remaining, reset, retry
end

-- A quota refused in its period: the cost goes to the next one, whose start is then the stamp.
local function q_reserve(p, at)
  p.x, p.xe = p.x + p.cost, p.next_stop
  redis.call('HSET', p.key, 'p', int(p.period), 'e', int(p.stop), 'n', int(p.used),
             'x', int(p.x), 'xe', int(p.xe))
  local us = p.xe - p.now
  if us < 0 then
    us = 0
  end
  redis.call('PEXPIRE', p.key, ttl_ms(us + QUOTA_MARGIN_US))
  p.period = p.stop
  local reset = 0
  if p.x > 0 then
    reset = p.xe - at
    if reset < 0 then
      reset = 0
    end
  end
  return p.limit, left(p.limit, p.x), reset, 0
end

local SLOTS = { [tb_outcome] = tb_slot, [sw_outcome] = sw_slot, [swb_outcome] = swb_slot,
                [q_outcome] = q_slot }
local RESERVES = { [tb_outcome] = tb_reserve, [sw_outcome] = sw_reserve,
                   [swb_outcome] = swb_reserve, [q_outcome] = q_reserve }

-- Whether any of a decision's policies paces (a charge or a peek never does).
local function paces(abase, policies)
  if peeking or force_all then
    return false
  end
  for i = 1, policies do
    local mode = argv[abase + 6 * (i - 1) + 5]
    if mode and mode >= PACED then
      return true
    end
  end
  return false
end

-- Appends every policy's refund stamps to `reply` after index r: the first is where the policy
-- counted (an exact window's time, a bucketed window's bucket, the lease, the quota's period;
-- 0 for a bucket), the second `s2` (a delayed decision's slot, else 0). Returns the new end.
local function stamps(policies, reply, r, s2)
  for i = 1, policies do
    local p = plans[i]
    local s1 = p.t or p.current or p.lease or p.period or 0
    reply[r + 1], reply[r + 2] = s1, s2
    r = r + 2
  end
  return r
end

-- Per policy: its max delay when it paces (false otherwise), and its slot (false: never).
local max_delays, slots = {}, {}

-- decide() for a decision with a paced policy. Reply as decide's, but allowed_all is 1 + the
-- delay in µs when the request is admitted for later, and then every policy's second refund
-- stamp is the slot (Redis TIME µs); a window's first stamp is where it recorded the request.
local function decide_paced(kbase, abase, policies, now, reply, rn)
  local at = now
  for i = 1, policies do
    local a = abase + 6 * (i - 1)
    local p, err = eval_policy(i, KEYS[kbase + i], a, now)
    if not p then
      return nil, err
    end
    plans[i] = p
    local mode, slot_of = argv[a + 5] or 0, SLOTS[outcomes[i]]
    max_delays[i], slots[i] = false, false
    if mode >= PACED and slot_of then
      max_delays[i] = mode - PACED
      slots[i] = slot_of(p) or false
      if slots[i] and slots[i] > at then
        at = slots[i]
      end
    end
  end
  local delay = at - now
  local all_allowed = true
  for i = 1, policies do
    local ok = plans[i].allowed
    if max_delays[i] then
      ok = slots[i] and delay <= max_delays[i]
    end
    plans[i].ok = ok and true or false
    all_allowed = all_allowed and (plans[i].ok or argv[abase + 6 * (i - 1) + 5] == 1)
  end
  local r = rn + 1
  reply[r] = 0
  if all_allowed then
    reply[r] = 1 + delay
  end
  for i = 1, policies do
    local p = plans[i]
    local consumed = all_allowed and p.ok
    local limit, remaining, reset, retry
    local reserve, at_slot = RESERVES[outcomes[i]], false
    if outcomes[i] == q_outcome then
      -- A paced quota refused in its period takes the next one, even with no delay.
      at_slot = consumed and not p.allowed and p.cost > 0
    else
      at_slot = consumed and delay > 0 and reserve and (max_delays[i] or outcomes[i] ~= tb_outcome)
    end
    if at_slot then
      -- Paced buckets and quotas and every window take the request at the slot.
      limit, remaining, reset, retry = reserve(p, at)
    else
      limit, remaining, reset, retry = outcomes[i](p, consumed)
      if consumed and p.cost > 0 then
        commits[i](p)
      end
      if p.ok then
        retry = 0
      elseif max_delays[i] and slots[i] then
        retry = delay - max_delays[i]
        if retry > MAX_US then
          retry = MAX_US
        end
      end
    end
    reply[r + 1], reply[r + 2], reply[r + 3], reply[r + 4], reply[r + 5] =
      p.ok and 1 or 0, limit, remaining, reset, retry
    r = r + 5
  end
  local stamp2 = 0
  if all_allowed and delay > 0 then
    stamp2 = at
  end
  return stamps(policies, reply, r, stamp2)
end

-- The usual decision, a single token bucket, in one straight line: tb_eval, tb_outcome and
-- tb_commit's arithmetic in the same order, without a plan table or a call between them (15% of
-- Redis's instructions for such a decision; docs/benchmarks.md). tests/conformance.rs holds both
-- paths to the spec: its single-bucket steps come here, its steps with several checks do not.
local function decide_tb(key, rate, burst, cost, shadow, now, reply, rn, force)
  local tokens, ts
  if key == bucket_key then
    tokens, ts = bucket_t, bucket_ts
  else
    if bucket_ttl then
      flush()
    end
    local h = call('HMGET', key, 't', 'ts')
    if h[1] and h[2] then
      -- A field that is not a number stays nil and fails the call below, as it always has.
      tokens, ts = tonumber(h[1]), tonumber(h[2])
    else
      tokens = false
    end
    bucket_key, bucket_t, bucket_ts = key, tokens, ts
  end
  if tokens == false then
    tokens, ts = burst, now
  end
  local elapsed = now - ts
  if elapsed < 0 then
    elapsed = 0
  end
  tokens = min(burst, tokens + elapsed * rate / MICROS)
  if ts < now then
    ts = now
  end
  local allowed = tokens >= cost
  -- Alone, the request is admitted exactly when this check allows (or only reports).
  local consumed = (allowed or force) and not peeking
  local after = tokens
  if consumed then
    after = tokens - cost
  end
  local reset = ceil_us((burst - after) * MICROS / rate)
  local retry = 0
  if not allowed then
    if cost > burst then
      retry = reset
    else
      retry = ceil_us((cost - tokens) * MICROS / rate)
    end
  end
  local remaining = floor(after)
  if remaining < 0 then
    remaining = 0
  end
  if consumed and cost > 0 then
    -- The bucket refills from ts, which a stepped-back clock can put in the future (ttl_ms).
    bucket_t, bucket_ts = tokens - cost, ts - ts % 1
    bucket_ttl = ceil((reset + (ts - now)) / 1000) + 1000
  end
  reply[rn + 1], reply[rn + 2], reply[rn + 3], reply[rn + 4] =
    (allowed or shadow == 1) and 1 or 0, allowed and 1 or 0, burst, remaining
  reply[rn + 5], reply[rn + 6], reply[rn + 7], reply[rn + 8] = reset, retry, 0, 0
  return rn + 8
end

-- One decision: `policies` checks whose keys start after KEYS[kbase] and whose six arguments each
-- start at argv[abase]; writes its reply into `reply` after index `rn` and returns the reply's new
-- last index, or nil and an error reply on bad arguments. Indices are counted, never taken with #:
-- the length operator is a search in Lua 5.1, and the hot path appends a dozen values a decision.
local function decide(kbase, abase, policies, now, reply, rn, force)
  if policies == 1 and argv[abase] == 'tb' and not (argv[abase + 5] and argv[abase + 5] >= PACED) then
    local rate, burst, cost = argv[abase + 1], argv[abase + 2], argv[abase + 4]
    if rate and burst and cost and argv[abase + 3] and cost >= 0 and rate > 0 and burst >= 0 then
      return decide_tb(KEYS[kbase + 1], rate, burst, cost, argv[abase + 5], now, reply, rn, force)
    end
  end
  -- Its checks read and write Redis directly, so the kept bucket goes first.
  flush()
  if paces(abase, policies) then
    return decide_paced(kbase, abase, policies, now, reply, rn)
  end
  local all_allowed = true
  for i = 1, policies do
    local a = abase + 6 * (i - 1)
    local p, err = eval_policy(i, KEYS[kbase + i], a, now)
    if not p then
      return nil, err
    end
    plans[i] = p
    all_allowed = all_allowed and (p.allowed or argv[a + 5] == 1)
  end

  local r = rn + 1
  reply[r] = all_allowed and 1 or 0
  for i = 1, policies do
    local p = plans[i]
    -- Consumed only when the request is admitted and this policy allows it; otherwise the
    -- outcome describes the state without the request.
    local consumed = ((all_allowed and p.allowed) or force) and not peeking
    local limit, remaining, reset, retry = outcomes[i](p, consumed)
    reply[r + 1], reply[r + 2], reply[r + 3], reply[r + 4], reply[r + 5] =
      p.allowed and 1 or 0, limit, remaining, reset, retry
    r = r + 5
    if consumed and p.cost > 0 then
      commits[i](p)
    end
  end
  -- The refund stamps, from what each policy read (a commit changes none of it).
  return stamps(policies, reply, r, 0)
end

-- Redis TIME in microseconds, read at most once per call.
local time_now = nil
local function now_of(arg)
  if arg ~= '' and arg ~= '-' then
    return tonumber(arg)
  end
  if not time_now then
    local t = redis.call('TIME')
    time_now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  end
  return time_now
end

-- Copies `policies` checks' arguments from the words `src` at `a` into argv, each number
-- converted once (a word that is not one becomes nil, which decide() refuses).
local function numeric(src, a, policies)
  for b = a, a + 6 * (policies - 1), 6 do
    argv[b] = src[b]
    argv[b + 1], argv[b + 2], argv[b + 3] = tonumber(src[b + 1]), tonumber(src[b + 2]),
                                           tonumber(src[b + 3])
    argv[b + 4], argv[b + 5] = tonumber(src[b + 4]), tonumber(src[b + 5])
  end
end

-- The kinds of a packed batch, by their number there.
local KINDS = { 'tb', 'sw', 'cc', 'q' }

local reply = {}
local argc = #ARGV
local packed = ARGV[1] == 'packed'
if packed then
  -- Little-endian doubles: now (negative: Redis TIME), the number of checks, then per check
  -- kind (1 tb, 2 sw, 3 cc, 4 q), p1, p2, p3, cost, shadow (1 or 0). struct reads them in C.
  local s = ARGV[2]
  if argc ~= 2 or not s or #s % 8 ~= 0 then
    return redis.error_reply('decide.lua: a packed batch is one string of doubles')
  end
  local len, unpack_, pos, now, policies = #s, struct.unpack, 1, nil, nil
  argv[1], argc = 'batch', 1
  while pos <= len do
    if pos + 15 > len then
      return redis.error_reply('decide.lua: bad batch')
    end
    now, policies, pos = unpack_('<dd', s, pos)
    if policies < 1 or policies ~= floor(policies) or pos + 48 * policies - 1 > len then
      return redis.error_reply('decide.lua: bad batch')
    end
    if now < 0 then
      now = '-'
    end
    argv[argc + 1], argv[argc + 2] = now, policies
    argc = argc + 2
    for _ = 1, policies do
      local kind, p1, p2, p3, cost, shadow
      kind, p1, p2, p3, cost, shadow, pos = unpack_('<dddddd', s, pos)
      -- A negative kind is a paced quota's (q_eval), kept as the number.
      argv[argc + 1] = KINDS[kind] or (kind < 0 and kind) or '?'
      argv[argc + 2], argv[argc + 3] = p1, p2
      argv[argc + 4], argv[argc + 5], argv[argc + 6] = p3, cost, shadow
      argc = argc + 6
    end
  end
elseif ARGV[1] == 'batch' then
  argv[1] = 'batch'
end
if argv[1] == 'batch' then
  -- Decisions one after another, each all-or-nothing on its own and seeing the ones before.
  local src = ARGV
  local nkeys = #KEYS
  local k, a, rn, err = 0, 2, 0, nil
  while a <= argc do
    local policies = tonumber((packed and argv or src)[a + 1] or '')
    local now = now_of((packed and argv or src)[a])
    if not now or now < 0 then
      err = redis.error_reply('decide.lua: bad now')
      break
    end
    if not policies or policies < 1 or k + policies > nkeys or a + 1 + 6 * policies > argc then
      err = redis.error_reply('decide.lua: bad batch')
      break
    end
    if not packed then
      numeric(src, a + 2, policies)
    end
    local next_rn
    next_rn, err = decide(k, a + 2, policies, now, reply, rn, false)
    if not next_rn then
      break
    end
    rn, k, a = next_rn, k + policies, a + 2 + 6 * policies
  end
  -- Also after a bad decision: the decisions before it stand, as separate calls' would.
  flush()
  if err then
    return err
  end
  if k ~= nkeys then
    return redis.error_reply('decide.lua: bad batch')
  end
  if packed then
    -- The reply as little-endian doubles; the gateway truncates each toward zero, as Redis
    -- does a Lua number it returns as an integer. In slices: unpack returns few values at once.
    local parts = {}
    for i = 1, rn, 512 do
      local j = min(i + 511, rn)
      parts[#parts + 1] = struct.pack('<' .. string.rep('d', j - i + 1), unpack(reply, i, j))
    end
    return table.concat(parts)
  end
  return reply
end

-- A charge consumes every policy's cost unconditionally, a peek none; their ARGV are shifted by
-- one.
local force = ARGV[1] == 'charge'
force_all = force
peeking = ARGV[1] == 'peek'
local base = 0
if force or peeking then
  base = 1
end
if argc ~= 1 + base + 6 * #KEYS then
  return redis.error_reply('decide.lua: expected 1 + 6 ARGV per key')
end
local now = now_of(ARGV[1 + base])
if not now or now < 0 then
  return redis.error_reply('decide.lua: bad now')
end
numeric(ARGV, 2 + base, #KEYS)
local rn, err = decide(0, 2 + base, #KEYS, now, reply, 0, force)
flush()
if not rn then
  return err
end
return reply
