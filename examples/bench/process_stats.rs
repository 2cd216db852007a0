//! What Linux's `/proc` says about a process: its CPU seconds, a memory line of its status,
//! the sockets it holds open.

/// CPU seconds (user + system) a process used, from `/proc/<pid>/stat` (Linux; `None`
/// elsewhere).
pub(crate) fn cpu_seconds(pid: u32) -> Option<f64> {
    // /proc reports in USER_HZ clock ticks, which Linux fixes at 100 for user space.
    const TICKS_PER_SECOND: f64 = 100.0;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces; fields 3.. follow its closing parenthesis.
    let after_name = stat.get(stat.rfind(')')? + 1..)?;
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // utime and stime are fields 14 and 15, i.e. the 12th and 13th after the name.
    let user: u64 = fields.get(11)?.parse().ok()?;
    let system: u64 = fields.get(12)?.parse().ok()?;
    Some((user + system) as f64 / TICKS_PER_SECOND)
}

/// A line of `/proc/<pid>/status` in kB (`VmRSS`, `VmHWM`).
pub(crate) fn status_kb(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// Sockets a process has open (from /proc/<pid>/fd).
pub(crate) fn open_sockets(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter(|entry| {
                    std::fs::read_link(entry.path())
                        .is_ok_and(|target| target.to_string_lossy().starts_with("socket:"))
                })
                .count()
        })
        .unwrap_or(0)
}
