//! The codec threads of every migration an agent runs at once, bounded. Each migration's
//! shape asks for up to a thread per core (`Shape::choose`, `DestinationPipeline::threads_for`)
//! as if it ran alone; several at once would ask for several times the cores, and threads
//! beyond the cores only add hand-offs. So they take their threads from one budget of twice
//! the cores (a migration's threads wait on the link and on QEMU part of the time) and give them
//! back when they end; one that finds the budget spent codes on its own task, in as many
//! shards as its link asked for (the format does not depend on the threads).

use std::sync::{Arc, LazyLock, Mutex};

/// Codec threads for each core the agent may use.
const THREADS_PER_CORE: usize = 2;

/// Threads shared by the migrations of one agent.
#[derive(Debug, Clone)]
pub struct ThreadBudget(Arc<Mutex<Spent>>);

#[derive(Debug)]
struct Spent {
    limit: usize,
    taken: usize,
}

/// Threads taken from a budget, given back when dropped.
#[derive(Debug)]
pub struct Threads {
    budget: ThreadBudget,
    count: usize,
}

impl Threads {
    pub fn count(&self) -> usize {
        self.count
    }
}

impl Drop for Threads {
    fn drop(&mut self) {
        self.budget.lock().taken -= self.count;
    }
}

impl ThreadBudget {
    pub fn new(limit: usize) -> ThreadBudget {
        ThreadBudget(Arc::new(Mutex::new(Spent { limit, taken: 0 })))
    }

    /// This agent's: twice the cores it may use (`available_parallelism`: affinity and
    /// cgroups count).
    pub fn of_agent() -> &'static ThreadBudget {
        static BUDGET: LazyLock<ThreadBudget> = LazyLock::new(|| {
            let cores = std::thread::available_parallelism().map_or(1, usize::from);
            ThreadBudget::new(THREADS_PER_CORE * cores)
        });
        &BUDGET
    }

    /// Up to `wanted` threads, as many as are left.
    pub fn take(&self, wanted: usize) -> Threads {
        let mut spent = self.lock();
        let count = wanted.min(spent.limit - spent.taken);
        spent.taken += count;
        Threads {
            budget: self.clone(),
            count,
        }
    }

    /// Threads taken and not given back.
    pub fn taken(&self) -> usize {
        self.lock().taken
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Spent> {
        self.0.lock().expect("thread budget lock")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn migrations_share_the_threads_and_give_them_back() {
        let budget = ThreadBudget::new(8);
        let first = budget.take(6);
        let second = budget.take(6);
        let third = budget.take(6);
        assert_eq!((first.count(), second.count(), third.count()), (6, 2, 0));
        assert_eq!(budget.taken(), 8);
        drop(first);
        assert_eq!(budget.taken(), 2);
        assert_eq!(budget.take(3).count(), 3);
        // The 3 went back with their guard.
        assert_eq!(budget.taken(), 2);
        drop((second, third));
        assert_eq!(budget.taken(), 0);
        assert_eq!(budget.take(0).count(), 0);
    }

    #[test]
    fn the_agents_budget_is_twice_its_cores() {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let budget = ThreadBudget::of_agent();
        // Whatever other tests of this process hold, taking the rest spends it all.
        let rest = budget.take(usize::MAX);
        assert_eq!(budget.taken(), 2 * cores);
        drop(rest);
    }
}
